"""The opt-in instrumentation hooks of :class:`~afd_cupy.ffn.worker.FFNWorker`
(``recorder=``): benchmarks use them for busy time, queue depth and timelines. A worker
with a recorder serves with the Python loop (the hooks run per item)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from afd_cupy.handles import FFNWorkItem

if TYPE_CHECKING:
    from afd_cupy.ffn.worker import FFNWorker


class FFNRecorder(Protocol):
    """Opt-in hooks of :class:`FFNWorker` (``recorder=``), called on the worker's thread.

    Per receive: ``polling()`` before ``recv_ffn_work_item``, ``received(worker, item)`` when it
    returned an item (before the item is served or, in lockstep, held). Per compute batch (one
    item under async, one per (layer, stage) under lockstep): ``computing(items)`` before the
    experts are called, ``replying(items)`` after them, before the first reply is written, and
    ``served(items)`` after the last reply call returned. On cuda the expert and reply calls
    only enqueue work on the current stream: a recorder that wants device time records events
    there (and must not synchronize). With ``overlap=True`` ``served`` runs once the replies
    were handed to the reply lane: on cuda with the reply stream current (an event recorded
    there completes when the replies have run), on the host right after the hand-off.
    """

    def polling(self) -> None: ...

    def received(self, worker: "FFNWorker", item: FFNWorkItem) -> None: ...

    def computing(self, items: Sequence[FFNWorkItem]) -> None: ...

    def replying(self, items: Sequence[FFNWorkItem]) -> None: ...

    def served(self, items: Sequence[FFNWorkItem]) -> None: ...
