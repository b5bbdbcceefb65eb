"""Test-only kernel helpers: launch wrappers, the constants probe's table, route-table faults.

- ``launch_*``: check and launch one kernel on ``stream`` (default: CuPy's current stream),
  with the keyword arguments of its spec builder in :mod:`afd_cupy.kernels.specs`.
- :data:`WIRE_CONSTANT_NAMES`, :func:`expected_wire_constants`, :func:`read_wire_constants`: what
  ``raw_kernels/probes/wire_constants.cu`` writes, and what it must write.
- :data:`ROUTE_TABLE_FAULTS`: corruptions of a dedup route table that ``afd_dedup_expand`` (and
  ``wire.check_route_table``) must reject, with the row the verdict names.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import kernels, wire


# --- launch wrappers ---------------------------------------------------------------------------
def launch_dispatch_plan(*, stream=None, **kwargs) -> None:
    kernels.dispatch_plan_spec(**kwargs).launch(stream)


def launch_dispatch_scatter(*, stream=None, **kwargs) -> None:
    kernels.dispatch_scatter_spec(**kwargs).launch(stream)


def launch_wait_replies(*, stream=None, **kwargs) -> None:
    kernels.wait_replies_spec(**kwargs).launch(stream)


def launch_combine(*, stream=None, **kwargs) -> None:
    kernels.combine_spec(**kwargs).launch(stream)


def launch_wait_any(*, stream=None, **kwargs) -> None:
    kernels.wait_any_spec(**kwargs).launch(stream)


def launch_reply(*, stream=None, **kwargs) -> None:
    kernels.reply_spec(**kwargs).launch(stream)


def launch_dedup_expand(*, stream=None, **kwargs) -> None:
    kernels.dedup_expand_spec(**kwargs).launch(stream)


def launch_dedup_reply(*, stream=None, **kwargs) -> None:
    kernels.dedup_reply_spec(**kwargs).launch(stream)


def dtype_code(dtype) -> int:
    """Payload dtype code of a name, numpy/cupy dtype or torch dtype."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    name = str(name if name is not None else dtype).replace("torch.", "")
    if name not in kernels.DTYPE_CODES:
        raise ValueError(f"dtype must be one of {sorted(kernels.DTYPE_CODES)}, got {dtype!r}")
    return kernels.DTYPE_CODES[name]


# --- the constants probe -----------------------------------------------------------------------
_WIRE_NAMES = ("MAGIC", "VERSION", "ALIGN", "FLAG_SHUTDOWN", "FLAG_DEDUP", "FLAG_KEPT_REPLY",
               "FLAG_FP8", "SHUTDOWN_SEQ",
               "HDR_MAGIC", "HDR_VERSION", "HDR_SEQ", "HDR_SRC_RANK", "HDR_LAYER", "HDR_STAGE",
               "HDR_NUM_TOKENS", "HDR_ROUTED_TOKENS", "HDR_SHARED_TOKENS", "HDR_TOPK",
               "HDR_FLAGS", "HDR_ECHO_SEQ", "HDR_FIXED_WORDS",
               "ROUTE_TOKEN", "ROUTE_SHARED", "ROUTE_SLOTS", "ROUTE_FIXED_WORDS",
               "STATUS_OK", "STATUS_CAPACITY", "STATUS_TIMEOUT", "STATUS_BAD_HEADER",
               "STATUS_REPLY_MISMATCH", "STATUS_SHUTDOWN", "STATUS_BAD_EXPERT",
               "ST_CODE", "ST_PEER", "ST_SLOT", "ST_RING", "ST_EXPECTED", "ST_OBSERVED",
               "ST_COUNT", "ST_CAP", "ST_LAYER", "STATUS_WORDS",
               "DB_TICKET", "DB_STATUS", "DB_SLOT", "DB_FLAG", "DB_HEADER")
_DTYPE_NAMES = {"DT_BF16": "bfloat16", "DT_F16": "float16", "DT_F32": "float32"}
#: probes of the device dtype helpers (not constants of wire.cuh), with their expected values
PROBES = {"PROBE_ITEMSIZE_BF16": 2, "PROBE_ITEMSIZE_F16": 2, "PROBE_ITEMSIZE_F32": 4,
          "PROBE_BF16_BITS_OF_1_5": 0x3FC0, "PROBE_F16_BITS_OF_1_5": 0x3E00,
          "PROBE_4_TIMES_BF16_0xC010": -9, "PROBE_4_TIMES_F16_0xC080": -9}
#: sizeof(SlotGeometry), then the offset of each field (layout probes, not constants)
GEOMETRY_NAMES = ("GEO_SIZEOF",) + tuple(
    f"GEO_{name.upper()}" for name in wire.WindowLayout.KERNEL_GEOMETRY_DTYPE.names)

#: order of the values written by afd_read_wire_constants (raw_kernels/probes/wire_constants.cu)
WIRE_CONSTANT_NAMES = (_WIRE_NAMES + tuple(_DTYPE_NAMES) + tuple(kernels.KERNEL_LIMITS)
                       + tuple(PROBES) + GEOMETRY_NAMES)


def is_mirrored_constant(name: str) -> bool:
    """True for the names that are constants of wire.cuh (not probes of helpers or layout)."""
    return not name.startswith(("PROBE_", "GEO_"))


def expected_wire_constants() -> dict:
    """name -> value that afd_read_wire_constants must return (from wire.py and kernels)."""
    values = {name: getattr(wire, name) for name in _WIRE_NAMES}
    values.update({name: kernels.DTYPE_CODES[dtype] for name, dtype in _DTYPE_NAMES.items()})
    values.update(kernels.KERNEL_LIMITS)
    values.update(PROBES)
    dtype = wire.WindowLayout.KERNEL_GEOMETRY_DTYPE
    values["GEO_SIZEOF"] = dtype.itemsize
    values.update({f"GEO_{name.upper()}": dtype.fields[name][1] for name in dtype.names})
    assert list(values) == list(WIRE_CONSTANT_NAMES)
    return values


def read_wire_constants() -> dict:
    """name -> value of the constants compiled into the kernels (synchronizes)."""
    import cupy

    out = cupy.full(len(WIRE_CONSTANT_NAMES), -12345, dtype=cupy.int64)
    kernels.get_kernel("probes/wire_constants.cu", "afd_read_wire_constants")((1,), (1,), (out,))
    return dict(zip(WIRE_CONSTANT_NAMES, (int(v) for v in out.get())))


# --- dedup route-table faults (afd_dedup_expand) ----------------------------------------------
def _slots(table: np.ndarray) -> np.ndarray:
    top_k = (table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    return table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k]


def _last_row_with(table: np.ndarray, min_slots: int) -> int | None:
    rows = np.flatnonzero((_slots(table) >= 0).sum(axis=1) >= min_slots)
    return int(rows[-1]) if rows.size else None


def _fault_token(table, *, num_tokens, shared_tokens, routed_tokens, high: bool):
    row = table.shape[0] // 2
    table[row, wire.ROUTE_TOKEN] = num_tokens + 3 if high else -1
    return row


def _fault_shared(table, *, num_tokens, shared_tokens, routed_tokens):
    row = shared_tokens - 1 if shared_tokens else table.shape[0] - 1  # the prefix's end, or a row after it
    table[row, wire.ROUTE_SHARED] ^= 1
    return row


def _fault_no_slot(table, *, num_tokens, shared_tokens, routed_tokens):
    row = table.shape[0] - 1
    _slots(table)[row, 0] = -1
    return row


def _fault_slot_after_pad(table, *, num_tokens, shared_tokens, routed_tokens):
    """A row with two pads names staging row P-1 in its last column (a pad stays before it; also
    a duplicate: the packing rule wins). Without such a row (top-2 tables), a row with a slot
    and a pad moves its slots one column right, behind the pad (no other rule broken)."""
    slots = _slots(table)
    pads = (slots < 0).sum(axis=1)
    rows = np.flatnonzero(pads >= 2)
    if rows.size:
        row = int(rows[-1])
        slots[row, -1] = routed_tokens - 1
        return row
    rows = np.flatnonzero((pads >= 1) & (slots[:, 0] >= 0))
    if not rows.size:
        return None
    row = int(rows[-1])
    slots[row] = np.roll(slots[row], 1)  # packed [s, .., -1] -> [-1, s, ..]
    return row


def _fault_out_of_range(table, *, num_tokens, shared_tokens, routed_tokens):
    row = _last_row_with(table, 1)
    _slots(table)[row, 0] = routed_tokens
    return row


def _fault_duplicate(table, *, num_tokens, shared_tokens, routed_tokens):
    if table.shape[0] < 2:
        return None
    slots = _slots(table)
    later = table.shape[0] - 1
    slots[later, 0] = slots[0, 0]  # row 0 names it first
    return later


def _fault_duplicate_in_row(table, *, num_tokens, shared_tokens, routed_tokens):
    row = _last_row_with(table, 2)
    if row is None:
        return None
    _slots(table)[row, 1] = _slots(table)[row, 0]
    return row


def _fault_missing_slot(table, *, num_tokens, shared_tokens, routed_tokens):
    row = _last_row_with(table, 2)
    if row is None:
        return None
    slots = _slots(table)
    slots[row, int((slots[row] >= 0).sum()) - 1] = -1  # its last staging row: nobody names it
    return -1


#: fault name -> corrupt(table (in place), num_tokens=, shared_tokens=, routed_tokens=): the row
#: the device must name (-1: the count rule, which names none), or None when the table has no
#: row the fault can be applied to. Each is a table wire.check_route_table rejects.
ROUTE_TABLE_FAULTS = {
    "token_too_large": lambda table, **kw: _fault_token(table, high=True, **kw),
    "token_negative": lambda table, **kw: _fault_token(table, high=False, **kw),
    "shared_not_a_prefix": _fault_shared,
    "no_staging_row": _fault_no_slot,
    "staging_row_after_pad": _fault_slot_after_pad,
    "staging_row_out_of_range": _fault_out_of_range,
    "duplicate_staging_row": _fault_duplicate,
    "duplicate_within_a_row": _fault_duplicate_in_row,
    "staging_row_missing": _fault_missing_slot,
}


def first_seed_taking(build, seed: int, *, what: str, attempts: int = 32):
    """(rng, result) for the first of the seeds ``seed``, ``seed + 1``, ... whose generator makes
    ``build(rng)`` return a result (not None), e.g. a random route table that a fault of
    :data:`ROUTE_TABLE_FAULTS` can be applied to. Deterministic; never skips: raises
    AssertionError naming ``what`` when none of ``attempts`` seeds does."""
    for attempt in range(attempts):
        rng = np.random.default_rng(seed + attempt)
        result = build(rng)
        if result is not None:
            return rng, result
    raise AssertionError(f"none of the seeds [{seed}, {seed + attempts}) gives {what}")
