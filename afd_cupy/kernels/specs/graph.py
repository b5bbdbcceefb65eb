"""Spec builders of ``raw_kernels/ffn/ffn_graph_stage.cu`` and ``ffn_graph_rows.cu``: the
graph-driven FFN (afd_cupy/ffn/graph.py, backends/cuda_ffn_graph.py): the stage (alone or
fused with the wait), the gather, the reply and their dedup twins.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.ffn import dedup_expand_grid, dedup_reply_grid, reply_grid
from afd_cupy.kernels.specs.limits import KERNEL_LIMITS, MAX_BLOCKS, MAX_TOP_K, payload_row_bytes


#: groups of one torch._grouped_mm problem list: fewer than 1024 (torch's CUTLASS path)
GRAPH_MAX_GROUPS = 1023


def _graph_stage_args(*, geo, expert_per_rank, is_dedup, src_rank, num_attn_ranks, token_cap,
                      routed_cap, shared_cap, routed_bucket, shared_bucket, num_layers,
                      layers_per_chunk, routed_offs, shared_offs, reply_seqs, state,
                      replay_counter, records, num_records, record_words, is_fp8=0) -> dict:
    """The checked arguments of the stage (afd_graph_stage and afd_graph_wait_stage), from geo on."""
    geo = checks.geometry("geo", geo)
    epr = checks.count("expert_per_rank", expert_per_rank, low=1)
    is_dedup = checks.count("is_dedup", is_dedup, high=1)
    is_fp8 = checks.count("is_fp8", is_fp8, high=1)
    if int(is_dedup) and int(is_fp8):
        raise ValueError("is_fp8=1 needs the pair wire mode (FP8 dispatch rows are pair rows), got is_dedup=1")
    if int(epr) + int(is_dedup) > GRAPH_MAX_GROUPS + 1 or \
            int(geo["header_words"]) != wire.HDR_FIXED_WORDS + int(epr) + int(is_dedup):
        raise ValueError(f"expert_per_rank={int(epr)} (is_dedup={int(is_dedup)}) must fit one "
                         f"grouped GEMM ({GRAPH_MAX_GROUPS} groups) and geo.header_words="
                         f"{int(geo['header_words'])}")
    num_layers = checks.count("num_layers", num_layers, low=1)
    layers_per_chunk = checks.count("layers_per_chunk", layers_per_chunk, low=1)
    if int(layers_per_chunk) * int(epr) > GRAPH_MAX_GROUPS:
        raise ValueError(f"layers_per_chunk * expert_per_rank = {int(layers_per_chunk) * int(epr)} "
                         f"> {GRAPH_MAX_GROUPS} groups")
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    record_words = checks.count("record_words", record_words,
                          low=STAGE_RECORD_HEADER + -(-int(geo["header_words"]) // 2)
                          + (wire.STATUS_WORDS if int(is_dedup) else 0))
    return {"geo": geo, "expert_per_rank": epr, "is_dedup": is_dedup, "is_fp8": is_fp8,
            "src_rank": checks.count("src_rank", src_rank),
            "num_attn_ranks": checks.count("num_attn_ranks", num_attn_ranks, low=1,
                                     high=int(geo["num_regions"])),
            "token_cap": checks.count("token_cap", token_cap), "routed_cap": checks.count("routed_cap", routed_cap),
            "shared_cap": checks.count("shared_cap", shared_cap),
            "routed_bucket": checks.count("routed_bucket", routed_bucket),
            "shared_bucket": checks.count("shared_bucket", shared_bucket),
            "num_layers": num_layers, "layers_per_chunk": layers_per_chunk,
            "routed_offs": checks.device_array("routed_offs", routed_offs, np.int32, int(num_layers) * int(epr)),
            "shared_offs": checks.address("shared_offs", shared_offs, allow_null=True),
            "reply_seqs": checks.device_array("reply_seqs", reply_seqs, np.int64, num_slots),
            "state": checks.device_array("state", state, np.int64,
                            STAGE_STATE_HEADER + -(-int(geo["header_words"]) // 2)),
            "replay_counter": checks.device_array("replay_counter", replay_counter, np.int64, 1),
            "records": checks.address("records", records),
            "num_records": checks.count("num_records", num_records, low=1), "record_words": record_words}


def graph_stage_spec(*, doorbell, **stage) -> LaunchSpec:
    """Decide what one graph replay does from the arrival ``afd_wait_any`` left in the DEVICE
    ``doorbell`` (afd_graph_stage; one block). Capturable: every input is read from device
    memory when the replay runs.

    ``stage`` (keywords): geo, expert_per_rank, is_dedup, src_rank, num_attn_ranks, token_cap,
    routed_cap, shared_cap, routed_bucket, shared_bucket, num_layers, layers_per_chunk,
    routed_offs, shared_offs, reply_seqs, state, replay_counter, records, num_records,
    record_words, and ``is_fp8`` (default 0; 1: an FP8 dispatch connector, whose dispatches
    must carry ``wire.FLAG_FP8``; 0: they must not; a header that disagrees is REJECTED as
    ``wire.dispatch_rows_fault`` says). Writes ``routed_offs`` int32 [num_layers * expert_per_rank] and
    ``shared_offs`` int32 [num_layers] (or null): cumulative end rows per group of the
    stacked-layer problem lists (``ffn_graph.routed_offsets_reference``); ``state`` int64
    [ffn_graph.state_words(...)]: what gather and reply read; increments ``reply_seqs[slot]``
    (int64 [num_slots]) for a served or eager item and ``replay_counter`` int64 [1]; one record
    of ``record_words`` int64 per replay into the pinned ring ``records`` [num_records,
    record_words] (dedup: room for the route-table verdict after the header words,
    ``ffn_graph.record_words(hw, dedup=True)``).
    """
    args = {"doorbell": checks.address("doorbell", doorbell), **_graph_stage_args(**stage)}
    return launch_spec(loader.get_kernel("ffn/ffn_graph_stage.cu", "afd_graph_stage"), 1, KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_wait_stage_spec(*, window, last_seen, scan_start, counts_snapshot, timeout_ns,
                          **stage) -> LaunchSpec:
    """afd_wait_any and afd_graph_stage in one kernel (afd_graph_wait_stage; one block): wait
    (bounded by ``timeout_ns``) for the next arrival in the own ``window`` as :func:`wait_any_spec`
    does (``last_seen`` int64 [num_slots], ``scan_start`` int32 [1], ``counts_snapshot`` int32
    [num_slots, header_words - HDR_FIXED_WORDS], all device, updated on arrival), then stage it
    as :func:`graph_stage_spec` does (``stage``: the same keywords, no doorbell)."""
    args = _graph_stage_args(**stage)
    geo = args["geo"]
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": checks.address("window", window),
            "last_seen": checks.device_array("last_seen", last_seen, np.int64, num_slots),
            "scan_start": checks.device_array("scan_start", scan_start, np.int32, 1),
            "counts_snapshot": checks.device_array("counts_snapshot", counts_snapshot, np.int32,
                                      num_slots * (int(geo["header_words"]) - wire.HDR_FIXED_WORDS)),
            "timeout_ns": checks.int64("timeout_ns", timeout_ns, low=0), **args}
    return launch_spec(loader.get_kernel("ffn/ffn_graph_stage.cu", "afd_graph_wait_stage"), 1, KERNEL_LIMITS["REPLY_THREADS"],
                 args)


#: int64 words before the header copy in the stage's state and record (ffn_graph.cuh
#: STATE_HEADER, REC_HEADER; afd_cupy.ffn.graph mirrors them and a CPU test parses the .cuh)
STAGE_STATE_HEADER = 9
STAGE_RECORD_HEADER = 6


def graph_gather_spec(*, dtype_code, window, geo, state, hidden_size, routed_staging,
                      shared_staging, routed_bucket, shared_bucket, fp8_rows=0,
                      max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Copy the served item's rows from its window slot into the fixed staging rows
    (afd_graph_gather<DT>). ``routed_staging`` / ``shared_staging``: payload [bucket, H]
    device addresses (shared 0 without shared experts). ``fp8_rows`` 1: the slot holds FP8
    wire rows (an FP8 dispatch connector: bf16/fp16 payload, ``hidden_size`` a multiple of
    ``wire.FP8_GROUP``), decoded into the staging rows as ``wire.fp8.dequantize_wire_rows``
    then the payload rounding give them. Grid for the bucket (frozen at capture).
    """
    geo = checks.geometry("geo", geo)
    routed_bucket = checks.count("routed_bucket", routed_bucket)
    shared_bucket = checks.count("shared_bucket", shared_bucket)
    code = checks.dtype_code(dtype_code)
    fp8_rows = checks.count("fp8_rows", fp8_rows, high=1)
    if int(fp8_rows) and (code == loader.DTYPE_CODES["float32"] or int(hidden_size) % wire.FP8_GROUP):
        raise ValueError(f"afd_graph_gather with fp8_rows=1 needs a bf16/fp16 dtype_code and hidden_size % "
                         f"{wire.FP8_GROUP} == 0, got dtype_code={dtype_code}, hidden_size={hidden_size}")
    args = {"window": checks.address("window", window), "geo": geo,
            "state": checks.device_array("state", state, np.int64, STAGE_STATE_HEADER),
            "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "routed_staging": checks.address("routed_staging", routed_staging),
            "shared_staging": checks.address("shared_staging", shared_staging, allow_null=True),
            "fp8_rows": fp8_rows}
    kernel = loader.get_kernel("ffn/ffn_graph_rows.cu", "afd_graph_gather", dtype_code=code)
    return launch_spec(kernel, reply_grid(int(routed_bucket) + int(shared_bucket), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_reply_spec(*, dtype_code, own_window, peer_windows, geo, src_rank, state, routed_outs,
                     shared_out, hidden_size, done_counter, routed_bucket, shared_bucket,
                     num_chunks=1, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Reply of a graph replay (afd_graph_reply<DT>): rows, header built by the stage, flag.

    ``peer_windows`` uint64 [num_regions] (device): Attention rank i's window as mapped here
    (0 for regions without one); ``routed_outs`` uint64 [num_chunks] (device): the routed
    output [routed_bucket, H] of each layer chunk, 0 = the own window slot's rows (identity);
    ``shared_out``: [shared_bucket, H] or 0 (own window rows). Grid for the bucket, a warp per
    part of a row (:func:`reply_grid` with the row bytes).
    """
    geo = checks.geometry("geo", geo)
    routed_bucket = checks.count("routed_bucket", routed_bucket)
    shared_bucket = checks.count("shared_bucket", shared_bucket)
    args = {"own_window": checks.address("own_window", own_window),
            "peer_windows": checks.device_array("peer_windows", peer_windows, np.uint64, int(geo["num_regions"])),
            "geo": geo, "src_rank": checks.count("src_rank", src_rank),
            "state": checks.device_array("state", state, np.int64, STAGE_STATE_HEADER),
            "routed_outs": checks.device_array("routed_outs", routed_outs, np.uint64, int(num_chunks)),
            "shared_out": checks.address("shared_out", shared_out, allow_null=True),
            "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    kernel = loader.get_kernel("ffn/ffn_graph_rows.cu", "afd_graph_reply", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, reply_grid(int(routed_bucket) + int(shared_bucket), max_blocks,
                                          row_bytes=payload_row_bytes(hidden_size, dtype_code)),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_dedup_expand_spec(*, dtype_code, window, geo, state, top_k, hidden_size, routed_staging,
                            shared_staging, route_copy, claims, fault, num_claimed, reply_seqs,
                            done_counter, token_cap, routed_cap, rows_bucket,
                            max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Copy, check and expand the served dedup item of a graph replay (afd_graph_dedup_expand<DT>):
    everything about the item is read from the stage's ``state`` when the replay runs.

    ``routed_staging`` / ``shared_staging``: payload [bucket, H] device addresses, 0 for none
    (identity experts: check and copy only); ``route_copy`` int32 [token_cap, 2 + 2 * top_k];
    scratch as :func:`dedup_expand_spec`'s (``claims`` [routed_cap]); ``reply_seqs`` the stage's
    (a rejected table gives its reserved seq back). A rejected table is written into the replay's
    record (GS_BAD_ROUTE, verdict after the header words). Grid for ``rows_bucket`` message rows
    (frozen at capture; any count is served).
    """
    geo = checks.geometry("geo", geo)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": checks.address("window", window), "geo": geo,
            "state": checks.device_array("state", state, np.int64, STAGE_STATE_HEADER + -(-int(geo["header_words"]) // 2)),
            "top_k": top_k, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "routed_staging": checks.address("routed_staging", routed_staging, allow_null=True),
            "shared_staging": checks.address("shared_staging", shared_staging, allow_null=True),
            "route_copy": checks.device_array("route_copy", route_copy, np.int32, int(checks.count("token_cap", token_cap)) * width),
            "claims": checks.device_array("claims", claims, np.int32, int(checks.count("routed_cap", routed_cap))),
            "fault": checks.device_array("fault", fault, np.uint64, 1),
            "num_claimed": checks.device_array("num_claimed", num_claimed, np.uint32, 1),
            "reply_seqs": checks.device_array("reply_seqs", reply_seqs, np.int64, num_slots),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    kernel = loader.get_kernel("ffn/ffn_graph_rows.cu", "afd_graph_dedup_expand", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, dedup_expand_grid(int(checks.count("rows_bucket", rows_bucket)), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_dedup_reply_spec(*, dtype_code, own_window, peer_windows, geo, src_rank, state, route_copy,
                           top_k, routed_outs, shared_out, hidden_size, done_counter, token_cap,
                           rows_bucket, num_chunks=1, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Reduce and reply of a graph replay in the dedup mode (afd_graph_dedup_reply<DT>): one reply
    row per received row, then the header the stage built and flag = the reply seq.

    ``route_copy``: the table :func:`graph_dedup_expand_spec`'s kernel accepted;
    ``routed_outs`` uint64 [num_chunks] (device): each layer chunk's grouped output [bucket, H]
    in staging order, 0 = identity experts (every slot reads the received row); ``shared_out``
    [bucket, H] or 0 (identity: the received row). Grid for ``rows_bucket`` rows (frozen).
    """
    geo = checks.geometry("geo", geo)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    args = {"own_window": checks.address("own_window", own_window),
            "peer_windows": checks.device_array("peer_windows", peer_windows, np.uint64, int(geo["num_regions"])),
            "geo": geo, "src_rank": checks.count("src_rank", src_rank),
            "state": checks.device_array("state", state, np.int64, STAGE_STATE_HEADER + -(-int(geo["header_words"]) // 2)),
            "route_copy": checks.device_array("route_copy", route_copy, np.int32, int(checks.count("token_cap", token_cap)) * width),
            "top_k": top_k,
            "routed_outs": checks.device_array("routed_outs", routed_outs, np.uint64, int(num_chunks)),
            "shared_out": checks.address("shared_out", shared_out, allow_null=True),
            "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    kernel = loader.get_kernel("ffn/ffn_graph_rows.cu", "afd_graph_dedup_reply", dtype_code=checks.dtype_code(dtype_code))
    grid = dedup_reply_grid(int(checks.count("rows_bucket", rows_bucket)), payload_row_bytes(hidden_size, dtype_code),
                            max_blocks)
    return launch_spec(kernel, grid, KERNEL_LIMITS["REPLY_THREADS"], args)
