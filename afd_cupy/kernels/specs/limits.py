"""The kernels' limits and the row geometry that several spec builders share.

:data:`KERNEL_LIMITS` is the one Python copy of the constants compiled into the kernels
(``raw_kernels/common/wire.cuh``; a CPU test parses wire.cuh, the GPU probe reads them back);
:func:`row_grid`, :func:`payload_row_bytes` and :func:`row_parts` size the row-copy kernels'
grids as the kernels walk their rows.
"""
from __future__ import annotations

from afd_cupy.kernels import checks
from afd_cupy.wire.dtypes import PAYLOAD_DTYPES


#: Limits and block sizes compiled into the kernels: the one Python copy of the constants of
#: raw_kernels/common/wire.cuh (a CPU test parses wire.cuh, the GPU probe reads them back).
KERNEL_LIMITS = {
    "CHUNK": 256,           # partials per afd_dispatch_plan block
    "MAX_BLOCKS": 1024,     # grid cap of the row-copy and combine kernels
    "MAX_FFN_RANKS": 256,   # static shared arrays of afd_dispatch_scatter
    "MAX_TOP_K": 64,        # static shared arrays of afd_combine
    "MAX_EXPERTS": 8192,    # dynamic shared memory of afd_dispatch_plan (4 B per expert)
    "ROWS_PER_BLOCK": 8,    # warps (one row each) of afd_dispatch_scatter and afd_reply
    "PLAN_THREADS": 256,
    "SCATTER_THREADS": 256,
    "WAIT_REPLIES_THREADS": 32,
    "COMBINE_THREADS": 256,
    "WAIT_ANY_THREADS": 32,
    "REPLY_THREADS": 256,
    "GATE_THREADS": 256,        # afd_gate_topk: a warp per token
    "GATE_MAX_EXPERTS": 1024,   # afd_gate_topk: 32 experts per lane, in registers
    "GATE_MAX_TOP_K": 32,       # afd_gate_topk: one lane per chosen expert
}
CHUNK = KERNEL_LIMITS["CHUNK"]
MAX_BLOCKS = KERNEL_LIMITS["MAX_BLOCKS"]
MAX_FFN_RANKS = KERNEL_LIMITS["MAX_FFN_RANKS"]
MAX_TOP_K = KERNEL_LIMITS["MAX_TOP_K"]
MAX_EXPERTS = KERNEL_LIMITS["MAX_EXPERTS"]
ROWS_PER_BLOCK = KERNEL_LIMITS["ROWS_PER_BLOCK"]


def payload_row_bytes(hidden_size, dtype_code) -> int:
    """Bytes of one payload row of ``hidden_size`` elements of kernel dtype ``dtype_code``."""
    code = checks.dtype_code(dtype_code)
    return int(hidden_size) * next(d.itemsize for d in PAYLOAD_DTYPES.values() if d.kernel_code == code)


def row_grid(num_rows: int, max_blocks: int) -> int:
    """Blocks of a row-copy kernel: one warp per row, ROWS_PER_BLOCK rows a block, at most
    ``max_blocks``, at least 1."""
    return max(1, min(-(-num_rows // ROWS_PER_BLOCK), max_blocks))


#: the dedup row kernels (afd_dedup_scatter, afd_dedup_reply) cut a payload row into one part
#: per this many bytes, at most ROW_MAX_PARTS, a warp each (wire.cuh: ROW_PART_BYTES,
#: ROW_MAX_PARTS, row_parts)
ROW_PART_BYTES = 4096
ROW_MAX_PARTS = 8


def row_parts(row_bytes: int) -> int:
    """Warps (column ranges) per payload row of the dedup row kernels, as they compute them."""
    return max(1, min(-(-int(row_bytes) // ROW_PART_BYTES), ROW_MAX_PARTS))


#: the combines cut token rows into parts (a block each) only up to this many blocks in all
#: (wire.cuh: COMBINE_PART_BLOCKS, combine_parts)
COMBINE_PART_BLOCKS = 128


#: the pair row kernels (afd_dispatch_fused, afd_graph_reply) cut rows into parts only up to
#: this many warps in all (wire.cuh: ROW_PART_WARPS, few_row_parts)
ROW_PART_WARPS = 1024


def few_row_parts(row_bytes: int, num_rows: int) -> int:
    """Warps per payload row of the pair row kernels for ``num_rows`` rows, as they compute it:
    :func:`row_parts` while the rows are few, fewer as they grow, 1 from ROW_PART_WARPS rows."""
    parts = row_parts(row_bytes)
    room = ROW_PART_WARPS // int(num_rows) if int(num_rows) > 0 else parts
    return max(1, min(room, parts))
