"""The launch specs agree with the kernels' C signatures, and PackedLaunch packs what it is given.

Everything runs on the CPU without CuPy: the signatures are parsed from ``raw_kernels/*.cu``;
the specs are built with the compiler and the CuPy array check replaced by stand-ins, so the
argument lists are compared by name, order and C type. PackedLaunch is driven with a fake
kernel and a fake ``cuLaunchKernel``. On the GPU every packed launch is exercised by the e2e
tests.
"""
import ctypes
import re

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.kernels import checks, launches, loader, specs

from helpers.paths import REPO_ROOT

# C parameter type -> the numpy scalar type a spec must hold for it ("ptr": an array argument)
_C_TYPES = {"afd_i32": np.int32, "afd_i64": np.int64, "afd_u64": np.uint64, "float": np.float32,
            "SlotGeometry": "SlotGeometry"}


def _c_signature(filename: str, name: str) -> list:
    """[(param name, numpy type, "ptr" or "SlotGeometry")] of kernel ``name`` in ``raw_kernels/filename``."""
    text = (kernels.KERNEL_DIR / filename).read_text()
    text = re.sub(r"//[^\n]*", "", text)
    match = re.search(rf"\b{name}\s*\((.*?)\)\s*\{{", text, re.S)
    assert match, f"{name} not found in {filename}"
    params = []
    for raw in match.group(1).split(","):
        decl = " ".join(raw.replace("__restrict__", "").split())
        param = decl.split()[-1].lstrip("*")
        if "*" in decl:
            params.append((param, "ptr"))
        else:
            ctype = decl.rsplit(" ", 1)[0].replace("const ", "")
            params.append((param, _C_TYPES[ctype]))
    return params


class _FakeArray:
    """Stands in for a CuPy array in a spec (the array check is replaced in these tests)."""


@pytest.fixture
def fake_specs(monkeypatch):
    # every spec module looks both up at call time (loader.get_kernel, checks.device_array)
    monkeypatch.setattr(loader, "get_kernel", lambda *a, **kw: "kernel")
    monkeypatch.setattr(checks, "device_array", lambda name, arr, dtype, min_size: _FakeArray())


_LAYOUT = wire.WindowLayout(num_regions=3, ring_depth=2, expert_per_rank=4, hidden_size=64,
                            itemsize=2, top_k=8, token_cap=8, routed_cap=64, shared_cap=4)
_DEDUP_LAYOUT = wire.WindowLayout(**{**_LAYOUT.as_dict(), "shared_cap": 8, "wire_mode": "dedup"})


def _specs() -> dict:
    arr, geo = _FakeArray(), _LAYOUT.kernel_geometry()
    replies = dict(window=0x3000, geo=geo, num_ffn_ranks=2, ring=1, expected=arr,
                   expected_counts=arr, layer_idx=3, stage_idx=1, last_seen=arr, reply_flags=arr,
                   timeout_ns=10**9, status=0x1000)
    return {
        ("attention/dispatch.cu", "afd_dispatch_plan"): kernels.dispatch_plan_spec(
            topk_ids=arr, num_partials=64, num_ffn_ranks=2, expert_per_rank=4, routed_cap=64,
            layer_idx=3, chunk_hist=arr, local_rank=arr, expert_counts=arr, expert_start=arr, rank_offsets=arr,
            verdict=arr, done_counter=arr, status=0x1000),
        ("attention/dispatch.cu", "afd_dispatch_scatter"): kernels.dispatch_scatter_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            num_partials=64, top_k=8, expert_per_rank=4, num_ffn_ranks=2, chunk_hist=arr,
            local_rank=arr, expert_start=arr, rank_offsets=arr, expert_counts=arr, verdict=arr,
            peer_windows=arr, geo=geo, ring=1, has_shared=1, pos_out=arr, src_rank=0,
            layer_idx=3, stage_idx=0, hdr_flags=0, seq_counters=arr, expected=arr,
            expected_counts=arr, done_counter=arr),
        ("attention/dispatch.cu", "afd_dispatch_fused"): kernels.dispatch_fused_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            num_partials=64, top_k=8, expert_per_rank=4, num_ffn_ranks=2, routed_cap=64,
            expert_counts=arr, expert_start=arr, rank_offsets=arr, verdict=arr, skipped=arr,
            peer_windows=arr, geo=geo, ring=1, has_shared=1, pos_out=arr, src_rank=0,
            layer_idx=3, stage_idx=0, hdr_flags=0, seq_counters=arr, expected=arr,
            expected_counts=arr, done_counter=arr, status=0x6000, max_partials=128),
        ("attention/routing.cu", "afd_own_routing"): kernels.own_routing_spec(
            weights_dtype_code=2, ids=0x2000, ids_int64=1, mask=1, num_experts=64, weights=0x2800,
            num_partials=64, ids_out=arr, weights_out=arr),
        ("attention/combine.cu", "afd_wait_replies"): kernels.wait_replies_spec(**replies),
        ("attention/combine.cu", "afd_combine"): kernels.combine_spec(
            dtype_code=0, out=0x4000, num_tokens=8, hidden_size=64, topk_ids=arr,
            topk_weights=arr, pos=arr, top_k=8, expert_per_rank=4, has_shared=1, out_scale=1.0,
            done_counter=arr, **replies),
        ("ffn/wait_any.cu", "afd_wait_any"): kernels.wait_any_spec(
            window=0x3000, geo=geo, last_seen=arr, scan_start=arr, counts_snapshot=arr, timeout_ns=10**9,
            doorbell=0x5000, ticket=7),
        ("ffn/reply.cu", "afd_reply"): kernels.reply_spec(
            dtype_code=1, dst_window=0x3000, geo=geo, src_rank=1, ring=1, routed_out=0,
            num_routed=0, shared_out=0x6000, num_shared=3, hidden_size=64, header_src=0x7000,
            seq=5, done_counter=arr),
        ("ffn/fp8_rows.cu", "afd_fp8_dequant_rows"): kernels.fp8_dequant_rows_spec(
            dtype_code=0, window=0x3000, geo=geo, slot=5, hidden_size=128, num_routed=7,
            num_shared=0, routed_out=0x6000, shared_out=0),
        ("ffn/dedup_ffn.cu", "afd_dedup_expand"): kernels.dedup_expand_spec(
            dtype_code=2, window=0x3000, geo=geo, region=2, ring=1, num_rows=20, num_tokens=30,
            num_routed=45, num_shared=7, top_k=8, hidden_size=64, staging=0x8000, route_copy=arr,
            claims=arr, fault=arr, num_claimed=arr, layer_idx=4, status=0x1000, done_counter=arr),
        ("ffn/dedup_ffn.cu", "afd_dedup_reply"): kernels.dedup_reply_spec(
            dtype_code=0, dst_window=0x3000, geo=geo, src_rank=1, ring=0, route_copy=arr,
            num_rows=20, top_k=8, routed_out=0x6000, num_routed=45, shared_out=0, num_shared=0,
            hidden_size=64, header_src=0x7000, seq=9, done_counter=arr),
        ("ffn/ffn_graph_stage.cu", "afd_graph_stage"): specs.graph_stage_spec(
            doorbell=0x5000, geo=geo, expert_per_rank=4, is_dedup=0, src_rank=1, num_attn_ranks=3,
            token_cap=8, routed_cap=64, shared_cap=4, routed_bucket=32, shared_bucket=4,
            num_layers=3, layers_per_chunk=2, routed_offs=arr, shared_offs=0x6000, reply_seqs=arr,
            state=arr, replay_counter=arr, records=0x7000, num_records=8, record_words=16),
        ("ffn/ffn_graph_stage.cu", "afd_graph_wait_stage"): specs.graph_wait_stage_spec(
            window=0x3000, last_seen=arr, scan_start=arr, counts_snapshot=arr, timeout_ns=10**9,
            geo=geo, expert_per_rank=4, is_dedup=0, src_rank=1, num_attn_ranks=3,
            token_cap=8, routed_cap=64, shared_cap=4, routed_bucket=32, shared_bucket=4,
            num_layers=3, layers_per_chunk=2, routed_offs=arr, shared_offs=0x6000, reply_seqs=arr,
            state=arr, replay_counter=arr, records=0x7000, num_records=8, record_words=16),
        ("ffn/ffn_graph_rows.cu", "afd_graph_gather"): specs.graph_gather_spec(
            dtype_code=0, window=0x3000, geo=geo, state=arr, hidden_size=64, routed_staging=0x8000,
            shared_staging=0, routed_bucket=32, shared_bucket=4),
        ("ffn/ffn_graph_rows.cu", "afd_graph_reply"): specs.graph_reply_spec(
            dtype_code=2, own_window=0x3000, peer_windows=arr, geo=geo, src_rank=1, state=arr,
            routed_outs=arr, shared_out=0, hidden_size=64, done_counter=arr, routed_bucket=32,
            shared_bucket=4, num_chunks=2),
        ("model/gate.cu", "afd_gate_topk"): specs.gate_topk_spec(
            dtype_code=0, logits=0x2000, num_tokens=8, num_experts=64, top_k=6, scoring=1,
            bias=0x3000, renormalize=1, topk_weights=0x4000, topk_ids=0x5000),
        **_dedup_specs(),
    }


def _dedup_specs() -> dict:
    arr, geo = _FakeArray(), _DEDUP_LAYOUT.kernel_geometry()
    replies = dict(window=0x3000, geo=geo, num_ffn_ranks=2, ring=1, expected=arr,
                   expected_counts=arr, layer_idx=3, stage_idx=1, last_seen=arr, reply_flags=arr,
                   timeout_ns=10**9, status=0x1000)
    return {
        ("attention/dedup_attn.cu", "afd_dedup_rows"): kernels.dedup_rows_spec(
            topk_ids=arr, num_tokens=8, top_k=8, expert_per_rank=4, num_ffn_ranks=2, has_shared=1,
            verdict=arr, rows_hist=arr, rows_local=arr, row_map=arr, shared_rank=arr,
            num_rows=arr, shared_rows=arr, done_counter=arr),
        ("attention/dedup_attn.cu", "afd_dedup_scatter"): kernels.dedup_scatter_spec(**_DEDUP_SCATTER),
        ("attention/dedup_attn_fused.cu", "afd_dedup_dispatch_fused"): kernels.dedup_dispatch_fused_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            topk_weights=arr, top_k=8, expert_per_rank=4, num_ffn_ranks=2, routed_cap=64,
            has_shared=1, expert_counts=arr, expert_start=arr, rank_offsets=arr, verdict=arr,
            skipped=arr, row_map=arr, shared_rank=arr, num_rows=arr, shared_rows=arr,
            peer_windows=arr, geo=geo, ring=1, src_rank=0, layer_idx=3, stage_idx=0,
            seq_counters=arr, expected=arr, expected_counts=arr, done_counter=arr,
            status=0x6000, max_tokens=16),
        ("attention/dedup_attn_ll.cu", "afd_dedup_dispatch_ll"): kernels.dedup_dispatch_ll_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            topk_weights=arr, top_k=8, expert_per_rank=4, num_ffn_ranks=2, routed_cap=64,
            has_shared=1, expert_counts=arr, expert_start=arr, rank_offsets=arr, verdict=arr,
            skipped=arr, row_map=arr, shared_rank=arr, num_rows=arr, shared_rows=arr,
            peer_windows=arr, geo=geo, ring=1, src_rank=0, layer_idx=3, stage_idx=0,
            seq_counters=arr, expected=arr, expected_counts=arr, done_counter=arr,
            status=0x6000, max_tokens=16),
        ("attention/dedup_attn.cu", "afd_dedup_combine"): kernels.dedup_combine_spec(
            dtype_code=2, out=0x4000, num_tokens=8, hidden_size=64, row_map=arr, out_scale=1.0,
            done_counter=arr, **replies),
        ("ffn/ffn_graph_rows.cu", "afd_graph_dedup_expand"): specs.graph_dedup_expand_spec(
            dtype_code=0, window=0x3000, geo=geo, state=arr, top_k=8, hidden_size=64,
            routed_staging=0x8000, shared_staging=0, route_copy=arr, claims=arr, fault=arr,
            num_claimed=arr, reply_seqs=arr, done_counter=arr, token_cap=8, routed_cap=64,
            rows_bucket=20),
        ("ffn/ffn_graph_rows.cu", "afd_graph_dedup_reply"): specs.graph_dedup_reply_spec(
            dtype_code=1, own_window=0x3000, peer_windows=arr, geo=geo, src_rank=1, state=arr,
            route_copy=arr, top_k=8, routed_outs=arr, shared_out=0x9000, hidden_size=7168,
            done_counter=arr, token_cap=8, rows_bucket=128, num_chunks=2),
    }


_DEDUP_SCATTER = dict(
    dtype_code=1, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=_FakeArray(),
    topk_weights=_FakeArray(), top_k=8, expert_per_rank=4, num_ffn_ranks=2,
    chunk_hist=_FakeArray(), local_rank=_FakeArray(), expert_start=_FakeArray(),
    rank_offsets=_FakeArray(), expert_counts=_FakeArray(), verdict=_FakeArray(),
    row_map=_FakeArray(), shared_rank=_FakeArray(), num_rows=_FakeArray(),
    shared_rows=_FakeArray(), peer_windows=_FakeArray(), geo=_DEDUP_LAYOUT.kernel_geometry(),
    ring=1, src_rank=0, layer_idx=3, stage_idx=0, seq_counters=_FakeArray(),
    expected=_FakeArray(), expected_counts=_FakeArray(), done_counter=_FakeArray())


def test_every_spec_matches_its_kernel_signature(fake_specs):
    """Same parameter names, same order, same C types as the .cu signature."""
    built = _specs()
    assert {name for _, name in built} == {name for entries in kernels.FILE_KERNELS.values()
                                           for name, _ in entries}
    for (filename, name), spec in built.items():
        c_params = _c_signature(filename, name)
        assert list(spec.names) == [c_name for c_name, _ in c_params], name
        for spec_name, value, (c_name, c_type) in zip(spec.names, spec.args, c_params):
            if c_type == "ptr":
                # an array, or a raw address (8 bytes, like the pointer)
                assert isinstance(value, (_FakeArray, np.uint64)), (name, spec_name, type(value))
            elif c_type == "SlotGeometry":
                assert isinstance(value, np.void)
                assert value.dtype == wire.WindowLayout.KERNEL_GEOMETRY_DTYPE, (name, spec_name)
            else:
                assert type(value) is c_type, (name, spec_name, type(value), c_type)


def test_specs_use_the_block_sizes_of_the_limit_table(fake_specs):
    built = _specs()
    limits = kernels.KERNEL_LIMITS
    blocks = {"afd_dispatch_plan": "PLAN_THREADS", "afd_dispatch_scatter": "SCATTER_THREADS",
              "afd_dispatch_fused": "SCATTER_THREADS", "afd_own_routing": "PLAN_THREADS",
              "afd_wait_replies": "WAIT_REPLIES_THREADS", "afd_combine": "COMBINE_THREADS",
              "afd_wait_any": "WAIT_ANY_THREADS", "afd_reply": "REPLY_THREADS",
              # the FFN's dedup row kernels: a warp per row, like afd_reply
              "afd_dedup_expand": "REPLY_THREADS", "afd_dedup_reply": "REPLY_THREADS",
              "afd_dedup_rows": "PLAN_THREADS", "afd_dedup_scatter": "SCATTER_THREADS",
              "afd_dedup_combine": "COMBINE_THREADS", "afd_dedup_dispatch_fused": "SCATTER_THREADS",
              "afd_dedup_dispatch_ll": "SCATTER_THREADS",
              "afd_graph_stage": "REPLY_THREADS", "afd_graph_wait_stage": "REPLY_THREADS",
              "afd_graph_gather": "REPLY_THREADS", "afd_fp8_dequant_rows": "REPLY_THREADS",
              "afd_graph_reply": "REPLY_THREADS", "afd_graph_dedup_expand": "REPLY_THREADS",
              "afd_graph_dedup_reply": "REPLY_THREADS", "afd_gate_topk": "GATE_THREADS"}
    for (filename, name), spec in built.items():
        assert spec.block == limits[blocks[name]], name
        text = (kernels.KERNEL_DIR / filename).read_text()
        assert re.search(rf"__launch_bounds__\({blocks[name]}\)\s*\n\s*{name}\(", text), name


def test_specs_reject_a_geometry_that_does_not_fit(fake_specs):
    arr = _FakeArray()
    with pytest.raises(ValueError, match="geo must be a WindowLayout.kernel_geometry"):
        kernels.wait_any_spec(window=1, geo={"flags_bytes": 0}, last_seen=arr, scan_start=arr,
                              counts_snapshot=arr, timeout_ns=1, doorbell=1, ticket=1)
    other = wire.WindowLayout(**{**_LAYOUT.as_dict(), "expert_per_rank": 5}).kernel_geometry()
    with pytest.raises(ValueError, match="header_words = 17, expected 16"):
        kernels.dispatch_scatter_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            num_partials=64, top_k=8, expert_per_rank=4, num_ffn_ranks=2, chunk_hist=arr,
            local_rank=arr, expert_start=arr, rank_offsets=arr, expert_counts=arr, verdict=arr,
            peer_windows=arr, geo=other, ring=1, has_shared=1, pos_out=arr, src_rank=0,
            layer_idx=3, stage_idx=0, hdr_flags=0, seq_counters=arr, expected=arr,
            expected_counts=arr, done_counter=arr)
    with pytest.raises(ValueError, match="ring must lie in"):
        kernels.reply_spec(dtype_code=1, dst_window=1, geo=_LAYOUT.kernel_geometry(), src_rank=0,
                           ring=2, routed_out=0, num_routed=0, shared_out=0, num_shared=0,
                           hidden_size=8, header_src=1, seq=1, done_counter=arr)


def test_dedup_specs_reject_impossible_sizes(fake_specs):
    arr, geo = _FakeArray(), _LAYOUT.kernel_geometry()
    expand = dict(dtype_code=0, window=0x3000, geo=geo, region=0, ring=0, num_rows=4, num_tokens=9,
                  num_routed=6, num_shared=2, top_k=2, hidden_size=64, staging=0x8000,
                  route_copy=arr, claims=arr, fault=arr, num_claimed=arr, layer_idx=0,
                  status=0x1000, done_counter=arr)
    kernels.dedup_expand_spec(**expand)
    with pytest.raises(ValueError, match="num_shared must lie in \\[0, 4\\]"):
        kernels.dedup_expand_spec(**{**expand, "num_shared": 5})
    with pytest.raises(ValueError, match="top_k must lie in \\[1, 64\\]"):
        kernels.dedup_expand_spec(**{**expand, "top_k": 65})
    with pytest.raises(ValueError, match="staging must be a non-null"):
        kernels.dedup_expand_spec(**{**expand, "staging": 0})
    with pytest.raises(ValueError, match="region must lie in \\[0, 2\\]"):
        kernels.dedup_expand_spec(**{**expand, "region": 3})
    kernels.dedup_expand_spec(**{**expand, "num_rows": 0, "num_routed": 0, "num_shared": 0,
                                 "staging": 0})  # a header-only message
    reply = dict(dtype_code=1, dst_window=0x3000, geo=geo, src_rank=1, ring=1, route_copy=arr,
                 num_rows=4, top_k=2, routed_out=0x6000, num_routed=6, shared_out=0x9000,
                 num_shared=2, hidden_size=64, header_src=0x7000, seq=3, done_counter=arr)
    kernels.dedup_reply_spec(**reply)
    with pytest.raises(ValueError, match="shared_out must be a non-null"):
        kernels.dedup_reply_spec(**{**reply, "shared_out": 0})
    with pytest.raises(ValueError, match="num_shared must lie in \\[0, 4\\]"):
        kernels.dedup_reply_spec(**{**reply, "num_shared": 5})
    with pytest.raises(ValueError, match="dtype_code must be one of"):
        kernels.dedup_reply_spec(**{**reply, "dtype_code": 3})
    # a put peer (dst_window 0): the reply goes to staging slot (dst_peer, ring), so both are needed
    put = kernels.dedup_reply_spec(**{**reply, "dst_window": 0, "staging": 0x9000, "dst_peer": 2})
    assert dict(zip(put.names, put.args))["staging"] == 0x9000
    with pytest.raises(ValueError, match="staging must be a non-null"):
        kernels.dedup_reply_spec(**{**reply, "dst_window": 0})
    with pytest.raises(ValueError, match="dst_peer must lie in \\[0, 2\\]"):
        kernels.dedup_reply_spec(**{**reply, "dst_window": 0, "staging": 0x9000, "dst_peer": 3})


def test_grids_of_the_specs(fake_specs):
    built = _specs()
    assert built[("attention/dispatch.cu", "afd_dispatch_scatter")].grid == kernels.scatter_grid(8, 8, 1) == 9
    assert kernels.scatter_grid(0, 8, 1) == 1 and kernels.scatter_grid(4096, 8, 1) == kernels.MAX_BLOCKS
    # hidden 64 bf16: a 128-byte row is one part; a 14 KiB row 4 parts (a vector a thread)
    # while tokens are few, fewer from 257 tokens, 1 from 513
    assert built[("attention/combine.cu", "afd_combine")].grid == kernels.combine_grid(8, 128) == 8
    assert kernels.combine_grid(0, 128) == 1
    assert kernels.combine_parts(7168 * 2, 1) == 4 and kernels.combine_grid(1, 7168 * 2) == 4
    assert kernels.combine_grid(32, 7168 * 2) == 128 and kernels.combine_parts(7168 * 2, 33) == 3
    assert kernels.combine_grid(128, 7168 * 2) == 128 and kernels.combine_parts(7168 * 2, 129) == 1
    assert kernels.combine_grid(4096, 7168 * 2) == kernels.MAX_BLOCKS
    assert kernels.combine_parts(7168 * 4, 1) == 7 and kernels.combine_parts(6, 1) == 1
    # a small combine waits for its replies itself (no wait kernel): 1-2 decode tokens
    assert kernels.combine_waits_itself(kernels.combine_grid(2, 7168 * 2))
    assert not kernels.combine_waits_itself(kernels.combine_grid(3, 7168 * 2))
    assert built[("ffn/reply.cu", "afd_reply")].grid == kernels.reply_grid(3) == 1
    assert built[("attention/dispatch.cu", "afd_dispatch_plan")].shared_mem == 4 * 8
    assert built[("attention/dispatch.cu", "afd_dispatch_plan")].grid == kernels.plan_grid(64) == 1
    assert kernels.plan_grid(0) == 1 and kernels.plan_grid(257) == 2
    assert built[("ffn/dedup_ffn.cu", "afd_dedup_expand")].grid == kernels.dedup_expand_grid(20) == 3
    # hidden 64 bf16: 128-byte rows, one warp each; 14 KiB rows: 4 warps (4096 B per part)
    assert built[("ffn/dedup_ffn.cu", "afd_dedup_reply")].grid == kernels.dedup_reply_grid(20, 128) == 3
    assert kernels.dedup_reply_grid(128, 7168 * 2) == 128 * 4 // kernels.ROWS_PER_BLOCK
    assert kernels.dedup_scatter_grid(128, 2, 7168 * 2) == 128 * 2 * 4 // kernels.ROWS_PER_BLOCK
    assert kernels.row_parts(4096) == 1 and kernels.row_parts(4097) == 2
    assert kernels.row_parts(10**6) == 8 and kernels.row_parts(0) == 1
    assert kernels.dedup_expand_grid(0) == 1 and kernels.dedup_reply_grid(0) == 1
    assert kernels.dedup_reply_grid(10**6, 7168 * 2) == kernels.MAX_BLOCKS


def test_dedup_grids_and_mode_checks(fake_specs):
    built = _dedup_specs()
    assert built[("attention/dedup_attn.cu", "afd_dedup_rows")].grid == kernels.dedup_rows_grid(8, 8) == 1
    assert kernels.dedup_rows_grid(0, 8) == 1 and kernels.dedup_rows_grid(65, 4) == 2
    assert built[("attention/dedup_attn.cu", "afd_dedup_scatter")].grid == kernels.dedup_scatter_grid(8, 2) == 2
    assert kernels.dedup_scatter_grid(0, 4) == 1 and kernels.dedup_scatter_grid(4096, 4) == kernels.MAX_BLOCKS
    assert built[("attention/dedup_attn.cu", "afd_dedup_combine")].grid == kernels.combine_grid(8, 64 * 4) == 8
    # the graph's dedup row kernels: grids for the bucket's message rows (frozen at capture)
    assert built[("ffn/ffn_graph_rows.cu", "afd_graph_dedup_expand")].grid == kernels.dedup_expand_grid(20) == 3
    assert built[("ffn/ffn_graph_rows.cu", "afd_graph_dedup_reply")].grid == \
        kernels.dedup_reply_grid(128, 7168 * 2) == 128 * 4 // kernels.ROWS_PER_BLOCK
    # the dedup scatter needs the dedup header (one more word than pair mode)
    with pytest.raises(ValueError, match="header_words = 16, expected 17"):
        kernels.dedup_scatter_spec(**{**_DEDUP_SCATTER, "geo": _LAYOUT.kernel_geometry()})
    arr = _FakeArray()
    wait = dict(window=0x3000, geo=_DEDUP_LAYOUT.kernel_geometry(), num_ffn_ranks=2, ring=1,
                expected=arr, expected_counts=arr, layer_idx=3, stage_idx=1, last_seen=arr,
                reply_flags=arr, timeout_ns=1, status=0x1000)
    assert kernels.wait_replies_spec(**wait, dedup=1).args[-1] == np.int32(1)
    assert kernels.wait_replies_spec(**wait).args[-1] == np.int32(0)  # pair by default
    with pytest.raises(ValueError, match="dedup must lie in"):
        kernels.wait_replies_spec(**wait, dedup=2)


def test_graph_specs_take_the_fp8_row_format_in_pair_mode_only(fake_specs):
    """The stage's ``is_fp8`` (right after ``is_dedup``, as in the C signature) and the gather's
    ``fp8_rows`` (last) default to 0 and are checked flags; FP8 rows need the pair mode, a
    16-bit payload and H % FP8_GROUP == 0."""
    arr, geo = _FakeArray(), _LAYOUT.kernel_geometry()
    stage = dict(doorbell=0x5000, geo=geo, expert_per_rank=4, is_dedup=0, src_rank=1, num_attn_ranks=3,
                 token_cap=8, routed_cap=64, shared_cap=4, routed_bucket=32, shared_bucket=4,
                 num_layers=3, layers_per_chunk=2, routed_offs=arr, shared_offs=0x6000, reply_seqs=arr,
                 state=arr, replay_counter=arr, records=0x7000, num_records=8, record_words=16)
    assert specs.graph_stage_spec(**stage).args[4] == np.int32(0)
    spec = specs.graph_stage_spec(**stage, is_fp8=1)
    assert spec.names[3:6] == ("is_dedup", "is_fp8", "src_rank") and spec.args[4] == np.int32(1)
    with pytest.raises(ValueError, match=r"is_fp8 must lie in \[0, 1\], got 2"):
        specs.graph_stage_spec(**stage, is_fp8=2)
    dedup = {**stage, "geo": _DEDUP_LAYOUT.kernel_geometry(), "is_dedup": 1, "record_words": 32}
    with pytest.raises(ValueError, match="is_fp8=1 needs the pair wire mode"):
        specs.graph_stage_spec(**dedup, is_fp8=1)
    gather = dict(dtype_code=0, window=0x3000, geo=geo, state=arr, hidden_size=256, routed_staging=0x8000,
                  shared_staging=0, routed_bucket=32, shared_bucket=4)
    assert specs.graph_gather_spec(**gather).args[-1] == np.int32(0)
    assert specs.graph_gather_spec(**gather, fp8_rows=1).args[-1] == np.int32(1)
    for change in ({"dtype_code": loader.DTYPE_CODES["float32"]}, {"hidden_size": 192}):
        with pytest.raises(ValueError, match=r"fp8_rows=1 needs a bf16/fp16 dtype_code and hidden_size % 128"):
            specs.graph_gather_spec(**{**gather, **change}, fp8_rows=1)
    with pytest.raises(ValueError, match=r"fp8_rows must lie in \[0, 1\]"):
        specs.graph_gather_spec(**gather, fp8_rows=-1)


def test_dedup_specs_size_expected_counts_with_three_columns(monkeypatch):
    monkeypatch.setattr(loader, "get_kernel", lambda *a, **kw: "kernel")
    seen = {}
    monkeypatch.setattr(checks, "device_array", lambda name, arr, dtype, min_size: seen.setdefault(
        (len(seen), name), min_size))
    arr = _FakeArray()
    wait = dict(window=0x3000, geo=_DEDUP_LAYOUT.kernel_geometry(), num_ffn_ranks=2, ring=1,
                expected=arr, expected_counts=arr, layer_idx=3, stage_idx=1, last_seen=arr,
                reply_flags=arr, timeout_ns=1, status=0x1000)
    kernels.wait_replies_spec(**wait, dedup=1)
    kernels.wait_replies_spec(**wait)
    kernels.dedup_scatter_spec(**_DEDUP_SCATTER)
    sizes = [size for (_, name), size in seen.items() if name == "expected_counts"]
    assert sizes == [6, 4, 6]  # [F, 3] in dedup mode, [F, 2] in pair mode
    row_maps = [size for (_, name), size in seen.items() if name == "row_map"]
    assert row_maps == [16]  # [T, F]


class _Kernel:
    class kernel:
        ptr = 0xF00D


def _param(packed, i, ctype):
    address = ctypes.cast(packed.params_ptr, ctypes.POINTER(ctypes.c_void_p))[i]
    return ctypes.cast(address, ctypes.POINTER(ctype))[0]


def test_packed_launch_packs_sets_and_launches():
    geo = _LAYOUT.kernel_geometry()
    values = {"a": np.uint64(0xDEADBEEF00), "n": np.int32(-7), "off": np.int64(1 << 40),
              "scale": np.float32(0.5), "count": np.uint32(3), "geo": geo}
    spec = kernels.LaunchSpec(_Kernel(), 5, 256, 128, tuple(values), tuple(values.values()))
    packed = kernels.PackedLaunch(spec)
    calls = []
    packed._launch_kernel = lambda *a: calls.append(a)  # cupy.cuda.driver.launchKernel

    got = [_param(packed, 0, ctypes.c_uint64), _param(packed, 1, ctypes.c_int32),
           _param(packed, 2, ctypes.c_int64), _param(packed, 3, ctypes.c_float),
           _param(packed, 4, ctypes.c_uint32)]
    assert got == [0xDEADBEEF00, -7, 1 << 40, 0.5, 3]
    geo_address = ctypes.cast(packed.params_ptr, ctypes.POINTER(ctypes.c_void_p))[5]
    assert ctypes.string_at(geo_address, geo.dtype.itemsize) == geo.tobytes()
    packed.set("n", 12345)
    packed.set("a", 0x1234)
    other = wire.WindowLayout(**{**_LAYOUT.as_dict(), "ring_depth": 3}).kernel_geometry()
    packed.set("geo", other)
    assert _param(packed, 1, ctypes.c_int32) == 12345 and _param(packed, 0, ctypes.c_uint64) == 0x1234
    assert ctypes.string_at(geo_address, geo.dtype.itemsize) == other.tobytes()
    assert packed.get("n") == 12345 and packed.get("geo") == other.tobytes()
    with pytest.raises(ValueError, match="needs 72 bytes"):
        packed.set("geo", b"short")
    packed.launch(0xABC)
    packed.launch(0xABC, grid=9)
    assert calls == [(0xF00D, 5, 1, 1, 256, 1, 1, 128, 0xABC, packed.params_ptr, 0),
                     (0xF00D, 9, 1, 1, 256, 1, 1, 128, 0xABC, packed.params_ptr, 0)]


def test_packed_launch_takes_an_array_by_its_device_pointer():
    class _Array:  # the attributes of a cupy.ndarray that PackedLaunch reads
        class data:
            ptr = 0xC0FFEE

    spec = kernels.LaunchSpec(_Kernel(), 1, 32, 0, ("buf",), (_Array(),))
    assert _param(kernels.PackedLaunch(spec), 0, ctypes.c_uint64) == 0xC0FFEE


def test_packed_launch_rejects_untyped_arguments():
    spec = kernels.LaunchSpec(_Kernel(), 1, 32, 0, ("n",), (7,))
    with pytest.raises(TypeError, match="argument n has type int"):
        kernels.PackedLaunch(spec)


def test_backend_sets_only_arguments_its_specs_have(fake_specs):
    """Every ``<launch>.set("name", ...)`` of the cuda backend names an argument of that kernel."""
    backends = REPO_ROOT / "afd_cupy" / "backends"  # the checkout's
    source = "\n".join((backends / name).read_text()
                       for name in ("cuda_attention.py", "cuda_routing.py", "cuda_ffn.py", "cuda_ffn_dedup.py"))
    by_var = {"plan": "afd_dispatch_plan", "scatter": "afd_dispatch_scatter",
              "wait": "afd_wait_replies", "combine": "afd_combine",
              "rows": "afd_dedup_rows", "dedup_scatter": "afd_dedup_scatter",
              "dedup_combine": "afd_dedup_combine", "dequant": "afd_fp8_dequant_rows",
              "own": "afd_own_routing",
              "launch": None}  # `launch`: wait_any, reply and the dedup kernels of the FFN
    names = {name: set(spec.names) for (_, name), spec in _specs().items()}
    sets = re.findall(r"\b(\w+)\.set\(\"(\w+)\"", source)
    sets = [(var, arg) for var, arg in sets if var != "self"]
    assert len(sets) >= 19
    for var, arg in sets:
        kernel = by_var[var]
        allowed = names[kernel] if kernel else (names["afd_wait_any"] | names["afd_reply"]
                                                | names["afd_dedup_expand"] | names["afd_dedup_reply"])
        assert arg in allowed, (var, arg)


def test_launches_module_has_no_cupy_import_at_module_level():
    import importlib
    import pkgutil

    modules = [launches, checks, specs] + [importlib.import_module(f"afd_cupy.kernels.specs.{m.name}")
                                           for m in pkgutil.iter_modules(specs.__path__)]
    assert len(modules) > 3
    for module in modules:
        assert module.__dict__.get("cupy") is None, module.__name__


@pytest.mark.parametrize("put", [False, True], ids=["direct", "put"])
@pytest.mark.parametrize("wire_mode,fused", [("pair", False), ("pair", True), ("dedup", False),
                                             ("dedup", True)],
                         ids=["pair", "pair-fused", "dedup", "dedup-fused"])
def test_backend_builds_the_launches_of_its_wire_mode(fake_specs, monkeypatch, wire_mode, fused, put):
    """CudaAttentionPath._attention_launches checks every spec of the layout's mode (a spec of
    the other mode would refuse the geometry); numpy arrays stand in for the CuPy buffers.
    With a put link every mode's scatter gets its staging (docs/design/put-transport.md). Pair mode with
    ``fused_dispatch``: one afd_dispatch_fused instead of plan + scatter; dedup mode: one
    afd_dedup_dispatch_fused instead of plan + rows + scatter."""
    import types

    from afd_cupy.backends import cuda_attention

    monkeypatch.setattr(kernels, "PackedLaunch", lambda spec: spec)
    # the arrays themselves in the specs: which buffer each kernel reads is checked below
    monkeypatch.setattr(checks, "device_array", lambda name, arr, dtype, min_size: arr)
    layout = _DEDUP_LAYOUT if wire_mode == "dedup" else _LAYOUT
    side = cuda_attention.CudaAttentionPath.__new__(cuda_attention.CudaAttentionPath)
    side.cp, side.layout, side.is_dedup = np, layout, layout.is_dedup
    side.fused_dispatch, side.ll_dispatch = fused, False
    side.ctx = types.SimpleNamespace(num_ffn_ranks=2, has_shared=True, always_send=False, role_rank=0)
    side.rank = types.SimpleNamespace(  # the shared CudaRank's fields the launches read
        geometry=layout.kernel_geometry(), own_window=0x3000, dtype_code=0, timeout_ns=10**9,
        link=types.SimpleNamespace(staging_base=0x9000 if put else 0),
        status=types.SimpleNamespace(ptr=0x1000), last_seen=_FakeArray())
    side.scratch = [types.SimpleNamespace(local_rank=np.zeros(64, np.int32), **{
        name: _FakeArray() for name in ("chunk_hist", "pos", "expert_counts", "expert_start",
                                        "rank_offsets", "verdict", "plan_done", "scatter_done",
                                        "skipped")})] * 2
    side.dedup_rows = [_FakeArray()] * 2
    for name in ("row_map", "shared_rank", "num_rows", "shared_rows", "rows_hist", "rows_local", "rows_done"):
        setattr(side.dedup_rows[0], name, _FakeArray())
    side.expected = side.expected_counts = side.reply_flags = side.combine_done = [_FakeArray()] * 2
    side.seq_counters, side.peer_windows = [_FakeArray()] * 2, _FakeArray()
    side.routing = types.SimpleNamespace(buffers=[(_FakeArray(), _FakeArray()) for _ in range(2)])
    launches = side._attention_launches(1)
    own_ids, own_weights = side.routing.buffers[1]  # afd_own_routing's outputs, set at build
    sender = dict(zip(launches["fused" if fused else "scatter"].names, launches["fused" if fused else "scatter"].args))
    assert sender["topk_ids"] is own_ids
    assert sender.get("topk_weights", own_weights) is own_weights
    if wire_mode == "pair":
        combine_args = dict(zip(launches["combine"].names, launches["combine"].args))
        assert combine_args["topk_ids"] is own_ids and combine_args["topk_weights"] is own_weights
    if fused:
        assert sorted(launches) == ["combine", "fused", "wait"]
        fused_args = dict(zip(launches["fused"].names, launches["fused"].args))
        assert fused_args["staging"] == (0x9000 if put else 0) and fused_args["status"] == 0x1000
        want_shared = (kernels.specs.dedup_fused_shared_bytes(layout.token_cap, layout.top_k,
                                                              2 * layout.expert_per_rank, 2)
                       if wire_mode == "dedup" else
                       kernels.specs.fused_shared_bytes(layout.token_cap * layout.top_k,
                                                        2 * layout.expert_per_rank))
        assert launches["fused"].shared_mem == want_shared  # sized for a full batch
        assert ("row_map" in launches["fused"].names) == (wire_mode == "dedup")
        assert ("row_map" in launches["combine"].names) == (wire_mode == "dedup")
        return
    want = {"pair": ["dispatch_plan", "dispatch_scatter", "wait_replies", "combine"],
            "dedup": ["dispatch_plan", "dedup_rows", "dedup_scatter", "wait_replies", "dedup_combine"]}
    assert sorted(launches) == sorted(["plan", "scatter", "wait", "combine"] + (["rows"] if wire_mode == "dedup" else []))
    names = {key: spec.names for key, spec in launches.items()}
    assert ("row_map" in names["combine"]) == (wire_mode == "dedup")
    assert launches["wait"].args[-1] == np.int32(wire_mode == "dedup")  # afd_wait_replies' dedup
    assert len(launches) == len(want[wire_mode])
    scatter = dict(zip(launches["scatter"].names, launches["scatter"].args))
    assert scatter["staging"] == (0x9000 if put else 0)


class _RecordingLaunch:
    """Stands in for PackedLaunch: keeps the spec, records set() and launch()."""

    def __init__(self, spec):
        self.spec, self.values, self.launched = spec, dict(zip(spec.names, spec.args)), []

    def set(self, name, value):
        assert name in self.values, name
        self.values[name] = value

    def launch(self, stream, grid=None):
        self.launched.append((stream, grid))


@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
def test_ffn_reply_writes_put_peers_into_the_staging_and_puts_its_rows(fake_specs, monkeypatch, wire_mode):
    """CudaFFNPath.reply (both modes) with a direct and a put Attention peer: the reply kernel
    of the put peer gets dst_window 0, the staging and the peer's region; the put copies the
    mode's rows (dedup: num_rows rows of routed_x and no shared rows; pair: R and S)."""
    import types

    import torch

    from afd_cupy.backends import cuda_ffn, cuda_ffn_dedup
    from afd_cupy.backends.base import Arrival
    from afd_cupy.wire.seq import SeqCounter

    monkeypatch.setattr(kernels, "PackedLaunch", _RecordingLaunch)
    layout = _DEDUP_LAYOUT if wire_mode == "dedup" else _LAYOUT
    puts = []
    side = cuda_ffn.CudaFFNPath.__new__(cuda_ffn.CudaFFNPath)
    side.layout = layout
    side.ctx = types.SimpleNamespace(role_rank=1, peer_pe=lambda role, rank: 10 + rank)
    side.window = types.SimpleNamespace(peer_ptr=lambda pe: 0x3000 + pe)
    side.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=lambda disable_timing: types.SimpleNamespace(record=lambda stream: None)))
    side.rank = types.SimpleNamespace(  # the shared CudaRank's fields and steps the reply uses
        geometry=layout.kernel_geometry(), dtype_code=0,
        link=types.SimpleNamespace(is_staged=(False, True, False), staging_base=0x9000,
                                   after_reply=lambda *a, **kw: puts.append((a, kw))),
        use_device=lambda: None, stream_ptr=lambda: 77, stream=lambda: None)
    num_slots = layout.num_slots
    side.reply_seqs, side.reply_launches = SeqCounter(num_slots), {}
    side.row_words = layout.header_words + layout.header_words % 2
    side.staging = types.SimpleNamespace(int32=np.zeros(num_slots * 4 * side.row_words, np.int32), ptr=0x7000)
    side._staging_row = lambda slot: slot * cuda_ffn.STAGING_DEPTH
    side.staging_events = [[None] * cuda_ffn.STAGING_DEPTH for _ in range(num_slots)]
    side.reply_done = [_FakeArray()] * num_slots
    side.dedup = None
    if wire_mode == "dedup":
        side.dedup = cuda_ffn_dedup.CudaDedupStaging.__new__(cuda_ffn_dedup.CudaDedupStaging)
        side.dedup.rank, side.dedup.ctx, side.dedup.layout = side.rank, side.ctx, layout
        side.dedup.route_copies = [_FakeArray()] * num_slots
        side.dedup.last_reply_event = [None] * num_slots
    # 5 rows (dedup), 7 partials over 4 local experts, 2 shared rows
    header = wire.dispatch_header(seq=3, src_rank=1, layer_idx=2, stage_idx=0, num_tokens=6,
                                  shared_tokens=2, top_k=8, expert_counts=[3, 0, 4, 0],
                                  wire_mode=wire_mode, num_rows=5 if wire_mode == "dedup" else 0)
    routed, shared = torch.zeros(7, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    for region in (0, 1):
        side.reply(Arrival(region, 1, header), routed, shared)
    direct, put = side.reply_launches[(0, 1)], side.reply_launches[(1, 1)]
    assert direct.values["dst_window"] == 0x3000 + 10 and put.values["dst_window"] == 0
    assert put.values["staging"] == 0x9000 and put.values["dst_peer"] == 1
    assert direct.values["dst_peer"] == 0 and put.launched == [(77, put.launched[0][1])]
    rows = (5, 0) if wire_mode == "dedup" else (7, 2)
    assert puts == [((77, 1, 1), dict(routed_rows=rows[0], shared_rows=rows[1], seq=1))]  # the put peer only


def test_row_parts_mirror_the_kernels():
    text = (kernels.KERNEL_DIR / "common" / "wire.cuh").read_text()
    values = dict(re.findall(r"constexpr afd_i64 ((?:ROW_(?:PART_BYTES|MAX_PARTS|PART_WARPS))|COMBINE_PART_BLOCKS) "
                             r"= (\d+);", text))
    assert {k: int(v) for k, v in values.items()} == {
        "ROW_PART_BYTES": specs.ROW_PART_BYTES, "ROW_MAX_PARTS": specs.ROW_MAX_PARTS,
        "ROW_PART_WARPS": specs.ROW_PART_WARPS, "COMBINE_PART_BLOCKS": specs.COMBINE_PART_BLOCKS}


def test_few_row_parts_spread_small_pair_messages_only():
    row = 7168 * 2  # a decode row: 4 parts of <= 4 KiB
    assert specs.row_parts(row) == 4
    assert specs.few_row_parts(row, 9) == 4        # 1 token, top-8 + a shared row
    assert specs.few_row_parts(row, 288) == 3      # 32 tokens: 1024 // 288
    assert specs.few_row_parts(row, 1152) == 1     # 128 tokens: a warp a row already
    assert specs.few_row_parts(row, 0) == 4 and specs.few_row_parts(256, 3) == 1
    # the grids count the warps the kernels walk (grid-stride loops: any grid is correct)
    assert kernels.scatter_grid(1, 8, 1, row_bytes=row) == -(-9 * 4 // kernels.ROWS_PER_BLOCK) == 5
    assert kernels.scatter_grid(128, 8, 1, row_bytes=row) == kernels.scatter_grid(128, 8, 1) == 144
    assert kernels.reply_grid(9, row_bytes=row) == 5 and kernels.reply_grid(9) == 2
