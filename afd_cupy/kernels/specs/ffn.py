"""Spec builders of the FFN side's eager kernels: ``raw_kernels/ffn/wait_any.cu``, ``reply.cu``
and ``dedup_ffn.cu`` (afd_wait_any, afd_reply, afd_dedup_expand, afd_dedup_reply), with
their grids.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.limits import (KERNEL_LIMITS, MAX_BLOCKS, MAX_TOP_K, payload_row_bytes,
                                           few_row_parts, row_grid, row_parts)


def wait_any_spec(*, window, geo, last_seen, scan_start, counts_snapshot, timeout_ns, doorbell,
                  ticket) -> LaunchSpec:
    """FFN arrival detection over every slot flag of the own window (afd_wait_any).

    ``last_seen`` int64 [num_slots] and ``scan_start`` int32 [1] live on the device and are
    updated on arrival; ``counts_snapshot`` int32 [num_slots, expert_per_rank] (device) gets
    the arrived header's expert counts in the won slot's row, from the same loads as the
    doorbell's header words. ``doorbell``: pinned int64 [DB_HEADER + ceil(header_words / 2)]; the
    kernel writes slot, flag, status (STATUS_OK / STATUS_TIMEOUT) and header words, then
    ``ticket`` into word DB_TICKET last: the host spins on that word. One block, one warp.
    """
    geo = checks.geometry("geo", geo)
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": checks.address("window", window), "geo": geo,
            "last_seen": checks.device_array("last_seen", last_seen, np.int64, num_slots),
            "scan_start": checks.device_array("scan_start", scan_start, np.int32, 1),
            "counts_snapshot": checks.device_array("counts_snapshot", counts_snapshot, np.int32,
                                      num_slots * (int(geo["header_words"]) - wire.HDR_FIXED_WORDS)),
            "timeout_ns": checks.int64("timeout_ns", timeout_ns, low=0),
            "doorbell": checks.address("doorbell", doorbell), "ticket": np.int64(ticket)}
    return launch_spec(loader.get_kernel("ffn/wait_any.cu", "afd_wait_any"), 1, KERNEL_LIMITS["WAIT_ANY_THREADS"], args)


def reply_spec(*, dtype_code, dst_window, geo, src_rank, ring, routed_out, num_routed, shared_out,
               num_shared, hidden_size, header_src, seq, done_counter, staging=0, dst_peer=0,
               max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Write ``num_routed`` + ``num_shared`` output rows, then header and flag = ``seq``, into
    slot (region = ``src_rank``, the own FFN rank; ``ring``) of an Attention peer's window
    (afd_reply<DT>).

    ``routed_out`` / ``shared_out``: payload [R, H] / [S, H] (may be 0 when the count is 0);
    ``header_src``: pinned int32 [header_words] prepared by the host; it must stay unchanged
    until the kernel has run (one buffer per in-flight reply). ``dst_window`` 0: the peer is
    reached by puts: rows and header go to slot (region = ``dst_peer``, ``ring``) of
    ``staging`` and no flag is stored (the host's put-with-signal sets it; docs/design/put-transport.md).
    Grid: :func:`reply_grid`.
    """
    num_routed = checks.count("num_routed", num_routed)
    num_shared = checks.count("num_shared", num_shared)
    geo = checks.geometry("geo", geo)
    is_put = not int(dst_window or 0)
    args = {"dst_window": checks.address("dst_window", dst_window, allow_null=True),
            "staging": checks.address("staging", staging, allow_null=not is_put),
            "dst_peer": checks.count("dst_peer", dst_peer, high=int(geo["num_regions"]) - 1),
            "geo": geo,
            "src_rank": checks.count("src_rank", src_rank, high=int(geo["num_regions"]) - 1),
            "ring": checks.count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "routed_out": checks.address("routed_out", routed_out, allow_null=num_routed == 0),
            "num_routed": num_routed,
            "shared_out": checks.address("shared_out", shared_out, allow_null=num_shared == 0),
            "num_shared": num_shared, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "header_src": checks.address("header_src", header_src), "seq": np.int64(seq),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    kernel = loader.get_kernel("ffn/reply.cu", "afd_reply", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, reply_grid(int(num_routed) + int(num_shared), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def fp8_dequant_rows_spec(*, dtype_code, window, geo, slot, hidden_size, num_routed, num_shared,
                          routed_out, shared_out, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Decode the FP8 wire rows of an FP8 dispatch (``wire.FLAG_FP8``) in slot number ``slot``
    of the own ``window`` into payload rows (afd_fp8_dequant_rows<DT>, bf16 or fp16): its
    ``num_routed`` routed rows into ``routed_out`` payload [R, H] and ``num_shared`` shared rows
    into ``shared_out`` payload [S, H] (device; 0 when the count is 0). Reference:
    ``wire.fp8.dequantize_wire_rows``, rounded to the payload dtype. ``hidden_size`` a multiple
    of ``wire.FP8_GROUP``. Safe in CUDA graph capture. Grid: :func:`reply_grid`.
    """
    geo = checks.geometry("geo", geo)
    num_routed = checks.count("num_routed", num_routed)
    num_shared = checks.count("num_shared", num_shared)
    code = checks.dtype_code(dtype_code)
    if code == loader.DTYPE_CODES["float32"] or int(hidden_size) % wire.FP8_GROUP:
        raise ValueError(f"afd_fp8_dequant_rows needs a bf16/fp16 dtype_code and hidden_size % "
                         f"{wire.FP8_GROUP} == 0, got dtype_code={dtype_code}, hidden_size={hidden_size}")
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": checks.address("window", window), "geo": geo,
            "slot": checks.int64("slot", slot, low=0),
            "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "num_routed": num_routed, "num_shared": num_shared,
            "routed_out": checks.address("routed_out", routed_out, allow_null=num_routed == 0),
            "shared_out": checks.address("shared_out", shared_out, allow_null=num_shared == 0)}
    if int(slot) >= num_slots:
        raise ValueError(f"slot must lie in [0, {num_slots}), got {slot}")
    kernel = loader.get_kernel("ffn/fp8_rows.cu", "afd_fp8_dequant_rows", dtype_code=code)
    return launch_spec(kernel, reply_grid(int(num_routed) + int(num_shared), max_blocks),
                       KERNEL_LIMITS["REPLY_THREADS"], args)


def reply_grid(num_rows: int, max_blocks: int = MAX_BLOCKS, row_bytes: int = 0) -> int:
    """Blocks of afd_reply and afd_graph_gather (``row_bytes`` 0: one warp per output row) and of
    afd_graph_reply (``row_bytes``: one warp per part of a row,
    :func:`~afd_cupy.kernels.specs.limits.few_row_parts`); at least 1."""
    return row_grid(num_rows * (few_row_parts(row_bytes, num_rows) if row_bytes else 1), max_blocks)


def dedup_expand_spec(*, dtype_code, window, geo, region, ring, num_rows, num_tokens, num_routed,
                      num_shared, top_k, hidden_size, staging, route_copy, claims, fault,
                      num_claimed, layer_idx, status, done_counter,
                      max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Copy and check the route table of slot (``region``, ``ring``) of the own ``window``, and
    expand its ``num_rows`` rows into grouped staging (afd_dedup_expand<DT>; dedup mode).

    ``staging``: payload [>= num_routed, H] (device address); ``route_copy``: int32
    [>= num_rows, 2 + 2 * top_k] (device), the copy the reply reduces through. Scratch, left as
    found: ``claims`` int32 [>= num_routed] all ``0x7fffffff``, ``fault`` uint64 [1] all ones,
    ``num_claimed`` and ``done_counter`` uint32 [1] zero. A table that
    ``wire.check_route_table`` would reject latches STATUS_BAD_HEADER in ``status`` (ST_PEER =
    ``region``, ST_SLOT = route-table column, ST_COUNT = row, ST_CAP = ``wire.ROUTE_FAULT_*``,
    ST_LAYER = ``layer_idx``; ``wire.route_table_error`` decodes it); nothing is written outside
    staging rows [0, num_routed) and route_copy rows [0, num_rows). Grid: :func:`dedup_expand_grid`.
    """
    geo = checks.geometry("geo", geo)
    num_rows = checks.count("num_rows", num_rows)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_routed = checks.count("num_routed", num_routed)
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    args = {"window": checks.address("window", window), "geo": geo,
            "region": checks.count("region", region, high=int(geo["num_regions"]) - 1),
            "ring": checks.count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "num_rows": num_rows, "num_tokens": checks.count("num_tokens", num_tokens),
            "num_routed": num_routed,
            "num_shared": checks.count("num_shared", num_shared, high=int(num_rows)),
            "top_k": top_k, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "staging": checks.address("staging", staging, allow_null=num_routed == 0),
            "route_copy": checks.device_array("route_copy", route_copy, np.int32, int(num_rows) * width),
            "claims": checks.device_array("claims", claims, np.int32, int(num_routed)),
            "fault": checks.device_array("fault", fault, np.uint64, 1),
            "num_claimed": checks.device_array("num_claimed", num_claimed, np.uint32, 1),
            "layer_idx": np.int32(layer_idx), "status": checks.address("status", status),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    kernel = loader.get_kernel("ffn/dedup_ffn.cu", "afd_dedup_expand", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, dedup_expand_grid(int(num_rows), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def dedup_expand_grid(num_rows: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_expand: one warp per route-table row, at least 1."""
    return row_grid(num_rows, max_blocks)


def dedup_reply_spec(*, dtype_code, dst_window, geo, src_rank, ring, route_copy, num_rows, top_k,
                     routed_out, num_routed, shared_out, num_shared, hidden_size, header_src, seq,
                     done_counter, staging=0, dst_peer=0, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Reduce the worker's outputs to one reply row per dispatch row and write them, then header
    and flag = ``seq``, into slot (region = ``src_rank``, ``ring``) of an Attention peer's
    window (afd_dedup_reply<DT>; dedup mode).

    ``route_copy``: int32 [num_rows, 2 + 2 * top_k] (device), the table afd_dedup_expand
    accepted; ``routed_out``: payload [num_routed, H] in staging order; ``shared_out``: payload
    [num_shared, H] (0 when num_shared is 0); both after ``moe.apply_routed_scaling``. Reply row
    r = round(sum_s w_s * routed_out[pos_s] (+ shared_out[r], r < num_shared)), fp32 in slot
    order, lands in ``routed_x`` row r of the slot. ``header_src``: pinned int32
    [header_words] (``wire.reply_header`` words with ``num_rows``), unchanged until the kernel
    ran. ``dst_window`` 0: the peer is reached by puts: rows and header go to slot (region =
    ``dst_peer``, ``ring``) of ``staging`` and no flag is stored (the host's put-with-signal
    sets it; docs/design/put-transport.md), as :func:`reply_spec`. Grid: :func:`dedup_reply_grid`.
    """
    geo = checks.geometry("geo", geo)
    is_put = not int(dst_window or 0)
    num_rows = checks.count("num_rows", num_rows)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_routed = checks.count("num_routed", num_routed)
    num_shared = checks.count("num_shared", num_shared, high=int(num_rows))
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    args = {"dst_window": checks.address("dst_window", dst_window, allow_null=True),
            "staging": checks.address("staging", staging, allow_null=not is_put),
            "dst_peer": checks.count("dst_peer", dst_peer, high=int(geo["num_regions"]) - 1),
            "geo": geo,
            "src_rank": checks.count("src_rank", src_rank, high=int(geo["num_regions"]) - 1),
            "ring": checks.count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "route_copy": checks.device_array("route_copy", route_copy, np.int32, int(num_rows) * width),
            "num_rows": num_rows, "top_k": top_k,
            "routed_out": checks.address("routed_out", routed_out, allow_null=num_routed == 0),
            "num_routed": num_routed,
            "shared_out": checks.address("shared_out", shared_out, allow_null=num_shared == 0),
            "num_shared": num_shared, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "header_src": checks.address("header_src", header_src), "seq": np.int64(seq),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    kernel = loader.get_kernel("ffn/dedup_ffn.cu", "afd_dedup_reply", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, dedup_reply_grid(int(num_rows), payload_row_bytes(hidden_size, dtype_code), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def dedup_reply_grid(num_rows: int, row_bytes: int = 0, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_reply: one warp per (reply row, part of the row), at least 1. The
    kernel strides over its items, so any grid is correct; this one keeps every item's warp
    in flight (``row_bytes`` = hidden size x payload itemsize)."""
    return row_grid(int(num_rows) * row_parts(row_bytes), max_blocks)
