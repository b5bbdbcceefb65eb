"""Symmetric heaps: ``nvshmem`` (cuda backend) and ``host`` (POSIX shared memory)."""
from afd_cupy.heap.base import SymmetricBuffer, SymmetricHeap  # noqa: F401
