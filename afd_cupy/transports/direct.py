"""The ``direct`` transport (the default): the sender's kernels (cuda) or host stores (host
backend) write straight into the peer's window through its mapping (``nvshmem_ptr`` on the
cuda backend, the shared-memory segment on the host backend), flag last. Every peer must map:
the window's allocation refuses one that does not, so set-up has nothing to agree on."""
from __future__ import annotations

from afd_cupy.transports.base import Link, Transport, register


class DirectTransport(Transport):
    name = "direct"
    is_host_initiated = False
    allows_unmapped_peers = False
    backends = ("host", "cuda")

    def open(self, heap, window, ctx, *, instance: int) -> Link:
        """Not collective: nothing is staged, the kernels' ``staging`` argument is 0."""
        return Link(self, window, ctx.opposite_pes())


DIRECT = register(DirectTransport())
