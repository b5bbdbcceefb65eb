"""CPU checks of the graph-driven FFN (afd_cupy/ffn/graph.py, raw_kernels/ffn/ffn_graph*): the
mirrored words, the stage reference against the protocol's rules, the offsets against what
torch._grouped_mm computes with them, and the bucket policy. No GPU, no CuPy."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.errors import ConfigError, WireError
from afd_cupy.ffn import graph as ffn_graph
from afd_cupy.kernels import specs

from helpers import kernels as kh
from helpers.layouts import small_layout

_CONSTEXPR_RE = re.compile(r"constexpr\s+int\s+(\w+)\s*=\s*(-?\d+)\s*;")
LAYOUT = small_layout()


def test_cu_words_match_the_python_mirror():
    text = (kernels.KERNEL_DIR / "ffn" / "ffn_graph.cuh").read_text()
    parsed = {name: int(value) for name, value in _CONSTEXPR_RE.findall(text)}
    names = [n for n in dir(ffn_graph) if re.match(r"(GS|STATE|REC)_[A-Z_]+$", n) and n != "GS_NAMES"]
    assert names and set(names) == set(parsed), set(names) ^ set(parsed)
    for name in names:
        assert parsed[name] == getattr(ffn_graph, name), name
    assert specs.STAGE_STATE_HEADER == ffn_graph.STATE_HEADER
    assert specs.STAGE_RECORD_HEADER == ffn_graph.REC_HEADER
    assert specs.GRAPH_MAX_GROUPS == ffn_graph.MAX_GROUPS
    for name in ("ffn_graph_stage.cu", "ffn_graph_rows.cu"):  # the kernels use the words of the header
        kernel_text = (kernels.KERNEL_DIR / "ffn" / name).read_text()
        assert '#include "ffn/ffn_graph.cuh"' in kernel_text and "__launch_bounds__(REPLY_THREADS)" in kernel_text
        assert not _CONSTEXPR_RE.search(kernel_text), name


def _dispatch(rng, *, layer=1, src=0, seq=7, counts=None, shared=3):
    counts = rng.integers(0, 6, LAYOUT.expert_per_rank) if counts is None else counts
    header = wire.dispatch_header(seq=seq, src_rank=src, layer_idx=layer, stage_idx=1,
                                  num_tokens=12, shared_tokens=shared, top_k=4, expert_counts=counts)
    return wire.encode_header(header, LAYOUT.expert_per_rank), header


def _stage(words, region=0, **kw):
    args = dict(layout=LAYOUT, src_rank=1, num_attn_ranks=2, num_layers=3, routed_bucket=24,
                shared_bucket=8, prev_seq=41)
    args.update(kw)
    return ffn_graph.stage_reference(words, region=region, **args)


def test_stage_reference_serves_a_fitting_item_with_the_wire_reply_header():
    rng = np.random.default_rng(1)
    words, header = _dispatch(rng)
    got = _stage(words)
    assert got.status == ffn_graph.GS_SERVED and got.seq == 42 and got.chunk == 0
    reply = wire.decode_header(got.reply_words, LAYOUT.expert_per_rank, LAYOUT)
    assert reply == wire.reply_header(header, seq=42, src_rank=1)
    assert reply.echo_seq == 7 and reply.expert_counts == header.expert_counts
    offs = got.routed_offs.reshape(3, -1)
    assert (offs[0] == 0).all() and (offs[2] == header.routed_tokens).all()
    assert offs[1].tolist() == np.cumsum(header.expert_counts).tolist()
    assert got.shared_offs.tolist() == [0, 3, 3]


@pytest.mark.parametrize("case", ["idle", "shutdown", "bad_magic", "bad_sum", "over_cap",
                                  "wrong_src", "no_attn_rank", "too_large", "layer_out"])
def test_stage_reference_statuses(case):
    rng = np.random.default_rng(2)
    words, _ = _dispatch(rng, counts=np.array([5, 5, 5, 5]))
    region, kw = 0, {}
    expected = {"idle": ffn_graph.GS_IDLE, "shutdown": ffn_graph.GS_SHUTDOWN,
                "too_large": ffn_graph.GS_EAGER, "layer_out": ffn_graph.GS_EAGER}.get(case, ffn_graph.GS_REJECTED)
    if case == "idle":
        region = None
    elif case == "shutdown":
        words = wire.encode_header(wire.shutdown_header(src_rank=0, top_k=4, expert_per_rank=4), 4)
    elif case == "bad_magic":
        words[wire.HDR_MAGIC] = 1
    elif case == "bad_sum":
        words[wire.HDR_FIXED_WORDS] += 1
    elif case == "over_cap":
        words[wire.HDR_FIXED_WORDS:] = 11
        words[wire.HDR_ROUTED_TOKENS] = 44  # > routed_cap 40
    elif case == "wrong_src":
        region = 1
    elif case == "no_attn_rank":
        words[wire.HDR_SRC_RANK] = region = 1
        kw["num_attn_ranks"] = 1
    elif case == "too_large":
        kw["routed_bucket"] = 19
    elif case == "layer_out":
        words[wire.HDR_LAYER] = 3
    got = _stage(words, region, **kw)
    assert got.status == expected, ffn_graph.GS_NAMES[got.status]
    assert not got.routed_offs.any() and not got.shared_offs.any(), "nothing served: all groups empty"
    assert got.seq == (42 if expected == ffn_graph.GS_EAGER else 0)
    assert got.reply_words is None


@pytest.mark.parametrize("receiver_fp8", [False, True])
def test_stage_reference_serves_only_its_own_row_format(receiver_fp8):
    """An FP8 dispatch connector's stage serves FLAG_FP8 dispatches and rejects payload ones,
    a payload connector's the reverse (wire.dispatch_rows_fault; the kernel's word: HDR_FLAGS);
    a shutdown has no rows and carries no row format either way."""
    layout = dataclasses.replace(LAYOUT, dispatch_dtype="fp8_e4m3") if receiver_fp8 else LAYOUT
    counts = np.array([2, 0, 3, 1])
    for sender_fp8 in (False, True):
        header = wire.dispatch_header(seq=7, src_rank=0, layer_idx=1, stage_idx=0, num_tokens=6,
                                      shared_tokens=2, top_k=2, expert_counts=counts, fp8=sender_fp8)
        got = _stage(wire.encode_header(header, LAYOUT.expert_per_rank), layout=layout)
        if sender_fp8 == receiver_fp8:
            assert got.status == ffn_graph.GS_SERVED and got.seq == 42
            reply = wire.decode_header(got.reply_words, LAYOUT.expert_per_rank, layout)
            assert reply.flags == 0  # replies are payload rows
        else:
            assert (got.status, got.detail, got.seq) == (ffn_graph.GS_REJECTED, wire.HDR_FLAGS, 0)
            assert not got.routed_offs.any() and got.reply_words is None
            with pytest.raises(WireError, match="dispatch_dtype="):
                wire.check_dispatch_rows(wire.decode_header(wire.encode_header(header, 4), 4, layout), layout)
    shutdown = wire.encode_header(wire.shutdown_header(src_rank=0, top_k=2, expert_per_rank=4), 4)
    assert _stage(shutdown, layout=layout).status == ffn_graph.GS_SHUTDOWN


def _grouped_rows(offs: np.ndarray) -> dict:
    """group -> (start, end) rows as torch._grouped_mm's 2d x 3d path derives them from offs
    (prepare_grouped_gemm_data: start = offs[g-1] or 0, size = offs[g] - start)."""
    starts = np.concatenate(([0], offs[:-1]))
    return {g: (int(s), int(e)) for g, (s, e) in enumerate(zip(starts, offs)) if e > s}


@pytest.mark.parametrize("num_layers,epr", [(3, 4), (5, 300), (1, 1023), (61, 32)])
def test_routed_offsets_give_gemm_work_to_the_arrived_layer_only(num_layers, epr):
    rng = np.random.default_rng(num_layers * epr)
    lpc = ffn_graph.layers_per_chunk(num_layers, epr)
    assert lpc * epr <= ffn_graph.MAX_GROUPS
    for layer in {0, num_layers // 2, num_layers - 1}:
        counts = rng.integers(0, 4, epr)
        counts[rng.integers(0, epr)] += 1
        offs = ffn_graph.routed_offsets_reference(counts, layer, num_layers, epr).reshape(num_layers, epr)
        work = {}
        for chunk in range(ffn_graph.num_chunks(num_layers, epr)):
            layers = range(chunk * lpc, min(num_layers, (chunk + 1) * lpc))
            chunk_offs = offs[layers.start:layers.stop].ravel()
            assert (np.diff(chunk_offs) >= 0).all() and chunk_offs[-1] <= counts.sum()
            for g, rows in _grouped_rows(chunk_offs).items():
                work[(layers.start + g // epr, g % epr)] = rows
        starts = np.cumsum(counts) - counts
        assert work == {(layer, e): (int(starts[e]), int(starts[e] + counts[e]))
                        for e in range(epr) if counts[e]}
    assert not ffn_graph.routed_offsets_reference(None, None, num_layers, epr).any()


def test_layer_chunks_and_their_limit():
    assert ffn_graph.layers_per_chunk(61, 32) == 31 and ffn_graph.num_chunks(61, 32) == 2
    assert ffn_graph.layers_per_chunk(4, 8) == 4 and ffn_graph.num_chunks(4, 8) == 1
    with pytest.raises(ConfigError, match="expert_per_rank=1024 > 1023"):
        ffn_graph.layers_per_chunk(1, 1024)


def test_buckets_and_policy():
    buckets = ffn_graph.buckets_for_tokens((32, 1, 128, 32), LAYOUT, top_k=4, num_ffn_ranks=2)
    assert buckets == (ffn_graph.Bucket(4, 1), ffn_graph.Bucket(40, 8))  # clipped at the caps
    assert ffn_graph.choose_bucket(buckets, 4, 1) == 0
    assert ffn_graph.choose_bucket(buckets, 5, 0) == 1
    assert ffn_graph.choose_bucket(buckets, 41, 0) is None
    policy = ffn_graph.BucketPolicy(buckets, window=3)
    assert policy.current == 0
    policy.observe(30, 2)
    assert policy.current == 1  # up at once
    for _ in range(2):
        policy.observe(1, 1)
    assert policy.current == 1  # the big item is still in the window
    policy.observe(1, 1)
    assert policy.current == 0
    policy.observe(99, 0)
    assert policy.current == 1  # nothing fits: the largest graph, the item itself went eager
    with pytest.raises(ConfigError, match="must be >= 1"):
        ffn_graph.buckets_for_tokens((0,), LAYOUT, top_k=4, num_ffn_ranks=1)


def test_record_and_state_sizes():
    assert ffn_graph.record_words(16) == 16 and ffn_graph.record_words(17) == 16
    assert ffn_graph.record_words(21) == 24
    assert ffn_graph.state_words(17) == ffn_graph.STATE_HEADER + 9


def test_server_module_imports_without_cupy():
    code = ("import sys, afd_cupy.backends.cuda_ffn_graph, afd_cupy.ffn.graph; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=kernels.KERNEL_DIR.parent)


# --------------------------------------------------------------------------- dedup wire mode
DEDUP_LAYOUT = small_layout(shared_cap=16, wire_mode="dedup")


def _dedup_message(rng, *, num_tokens=12, num_ffn=2, ffn_rank=0, has_shared=True):
    """(table, rows, header) of FFN rank ``ffn_rank``'s dedup message (numpy references)."""
    from afd_cupy.testing import dedup_reference as ref

    top_k, epr = DEDUP_LAYOUT.top_k, DEDUP_LAYOUT.expert_per_rank
    ids = np.stack([rng.permutation(num_ffn * epr)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    weights = (rng.random((num_tokens, top_k)) + 0.05).astype(np.float32)
    plan = ref.plan_reference(ids, num_ffn, epr, has_shared=has_shared)
    hidden = rng.integers(0, 2**16, (num_tokens, 8), dtype=np.uint16)
    table, rows = ref.scatter_reference(plan, hidden, ids, weights, ffn_rank)
    header = wire.dispatch_header(seq=9, src_rank=1, layer_idx=2, stage_idx=0, num_tokens=num_tokens,
                                  shared_tokens=int(plan.shared_rows[ffn_rank]), top_k=top_k,
                                  expert_counts=tuple(int(c) for c in plan.rank_counts(ffn_rank)),
                                  wire_mode="dedup", num_rows=int(plan.num_rows[ffn_rank]))
    return table, rows, header


def test_dedup_buckets_hold_one_row_per_token_and_every_shared_row():
    buckets = ffn_graph.buckets_for_tokens((1, 8, 64), DEDUP_LAYOUT, top_k=4, num_ffn_ranks=2)
    # a dedup rank gets at most T rows, may run every one of their shared experts, and its
    # staging holds up to T * K partials (clipped at the caps)
    assert buckets == (ffn_graph.Bucket(4, 1, 1), ffn_graph.Bucket(32, 8, 8), ffn_graph.Bucket(40, 16, 16))
    assert ffn_graph.identity_bucket(DEDUP_LAYOUT) == ffn_graph.Bucket(40, 16, 16)
    assert ffn_graph.identity_bucket(LAYOUT) == ffn_graph.Bucket(40, 8, 0)
    assert ffn_graph.buckets_for_tokens((8,), LAYOUT, top_k=4, num_ffn_ranks=2) == (ffn_graph.Bucket(32, 4),)


def test_stage_reference_serves_a_dedup_item_and_echoes_num_rows():
    rng = np.random.default_rng(5)
    _, _, header = _dedup_message(rng)
    words = wire.encode_header(header, 4)
    assert words.size == DEDUP_LAYOUT.header_words == 17
    args = dict(layout=DEDUP_LAYOUT, src_rank=0, num_attn_ranks=2, num_layers=3, routed_bucket=40,
                shared_bucket=16, prev_seq=3)
    got = ffn_graph.stage_reference(words, region=1, **args)
    assert got.status == ffn_graph.GS_SERVED and got.seq == 4
    reply = wire.decode_header(got.reply_words, 4, DEDUP_LAYOUT)
    assert reply.is_dedup and reply.num_rows == header.num_rows and reply.echo_seq == 9
    small = ffn_graph.stage_reference(words, region=1, **{**args, "shared_bucket": header.shared_tokens - 1})
    assert small.status == ffn_graph.GS_EAGER and small.seq == 4
    pair_words = wire.encode_header(wire.dispatch_header(
        seq=9, src_rank=1, layer_idx=2, stage_idx=0, num_tokens=12, shared_tokens=1, top_k=4,
        expert_counts=(1, 0, 0, 0)), 4)
    assert ffn_graph.stage_reference(np.append(pair_words, 1), region=1, **args).status == ffn_graph.GS_REJECTED


def _bad_route_record(table, header, verdict, *, ring=1):
    """The record afd_graph_dedup_expand leaves for a rejected table (what the stage wrote, then
    the verdict after the header words, status BAD_ROUTE, seq 0)."""
    hw = DEDUP_LAYOUT.header_words
    record = np.full(ffn_graph.record_words(hw, dedup=True), -5, np.int64)
    record[ffn_graph.REC_REPLAY], record[ffn_graph.REC_STATUS] = 17, ffn_graph.GS_BAD_ROUTE
    record[ffn_graph.REC_SLOT], record[ffn_graph.REC_SEQ] = 2 * header.src_rank + ring, 0
    words = wire.encode_header(header, 4)
    record[ffn_graph.REC_HEADER:].view(np.int32)[:hw] = words
    rule, row, column, expected, observed = verdict
    start = ffn_graph.verdict_offset(hw)
    record[start:start + wire.STATUS_WORDS] = [wire.STATUS_BAD_HEADER, header.src_rank, column, ring,
                                               expected, observed, row, rule, header.layer_idx]
    return record


def test_record_sizes_leave_room_for_the_dedup_verdict():
    for hw in (13, 16, 17, 21, 45):
        plain, dedup = ffn_graph.record_words(hw), ffn_graph.record_words(hw, dedup=True)
        assert plain % 8 == 0 and dedup % 8 == 0
        assert ffn_graph.verdict_offset(hw) == ffn_graph.REC_HEADER + -(-hw // 2) <= plain
        assert dedup >= ffn_graph.verdict_offset(hw) + wire.STATUS_WORDS
    assert ffn_graph.record_words(17, dedup=True) == 24  # 6 + 9 header + 9 verdict words
    assert specs.STAGE_STATE_HEADER == ffn_graph.STATE_HEADER == ffn_graph.STATE_RECORD + 1


@pytest.mark.parametrize("fault", sorted(kh.ROUTE_TABLE_FAULTS))
def test_bad_route_record_raises_the_eager_paths_wire_error(fault):
    """The verdict afd_graph_dedup_expand writes into a record (the numpy model of it) decodes to
    the WireError the eager path raises from afd_dedup_expand's status record: same words."""
    def faulty(rng):
        table, rows, header = _dedup_message(rng, num_tokens=24)
        bad = table.copy()
        row = kh.ROUTE_TABLE_FAULTS[fault](bad, num_tokens=header.num_tokens, shared_tokens=header.shared_tokens,
                                           routed_tokens=header.routed_tokens)
        return None if row is None else (rows, header, bad, row)

    _, (rows, header, bad, row) = kh.first_seed_taking(faulty, sorted(kh.ROUTE_TABLE_FAULTS).index(fault),
                                                       what=f"a table that takes fault {fault}")
    verdict, _, _ = ffn_graph.dedup_expand_reference(
        bad, rows, num_tokens=header.num_tokens, routed_tokens=header.routed_tokens,
        shared_tokens=header.shared_tokens)
    assert verdict is not None and verdict[1] == row
    err = ffn_graph.route_verdict(_bad_route_record(bad, header, verdict), DEDUP_LAYOUT)
    rule, row, column, expected, observed = verdict
    eager = wire.route_table_error(wire.StatusRecord(wire.STATUS_BAD_HEADER, header.src_rank, column, 1,
                                                     expected, observed, row, rule, header.layer_idx),
                                   shared_tokens=header.shared_tokens)
    assert isinstance(err, WireError) and str(err) == str(eager)
    assert f"attention rank {header.src_rank} (ring 1)" in str(err) and "layer 2" in str(err)
    with pytest.raises(WireError):
        wire.check_route_table(bad, num_tokens=header.num_tokens, routed_tokens=header.routed_tokens,
                               shared_tokens=header.shared_tokens, top_k=4)
    with pytest.raises(ValueError, match="is not BAD_ROUTE"):
        ffn_graph.route_verdict(np.zeros(24, np.int64), DEDUP_LAYOUT)


def test_dedup_references_agree_with_the_eager_steps():
    """expand: staging = dedup_reference.expand_reference, shared = the first S rows, no verdict;
    reply with identity experts = sum_s w_s * x_r (+ x_r when shared), the eager identity path."""
    from afd_cupy.testing import dedup_reference as ref

    rng = np.random.default_rng(11)
    table, rows, header = _dedup_message(rng, num_tokens=20)
    verdict, staging, shared = ffn_graph.dedup_expand_reference(
        table, rows, num_tokens=20, routed_tokens=header.routed_tokens, shared_tokens=header.shared_tokens)
    assert verdict is None
    np.testing.assert_array_equal(staging, ref.expand_reference(table, rows, header.routed_tokens))
    np.testing.assert_array_equal(shared, rows[:header.shared_tokens])
    x = rng.standard_normal((header.num_rows, 8)).astype(np.float32)
    got = ffn_graph.dedup_reply_reference(table, None, None, rows=x)
    weights = table[:, wire.ROUTE_SLOTS + 4:].copy().view(np.float32)
    want = np.zeros_like(x)
    for r in range(header.num_rows):
        for s in range(4):
            if table[r, wire.ROUTE_SLOTS + s] >= 0:
                want[r] += weights[r, s] * x[r]
        if r < header.shared_tokens:
            want[r] += x[r]
    np.testing.assert_array_equal(got, want)
    routed_out = rng.standard_normal((header.routed_tokens + 3, 8)).astype(np.float32)  # bucket rows
    shared_out = rng.standard_normal((header.shared_tokens + 2, 8)).astype(np.float32)
    np.testing.assert_array_equal(
        ffn_graph.dedup_reply_reference(table, routed_out, shared_out),
        ref.reduce_reference(table, routed_out[:header.routed_tokens], shared_out[:header.shared_tokens]))


def test_server_accepts_dedup_and_fp8_connectors_and_keeps_its_other_limits():
    from types import SimpleNamespace

    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer
    from afd_cupy.runtime.topology import Role

    from afd_cupy.backends.base import Capabilities

    def caps(backend="cuda", device_polling=True, put_peers=()):
        # the declared capabilities decide (as the cuda FFN path derives them), not the name
        return Capabilities(backend=backend, wire_modes=("pair", "dedup"),
                            supports_nonblocking=backend == "cuda", device_polling=device_polling,
                            host_reply_seqs=backend == "cuda", put_peers=put_peers,
                            supports_graph_server=backend == "cuda" and device_polling and not put_peers)

    def fake(**kw):
        base = dict(role=Role.FFN, backend="cuda", layout=DEDUP_LAYOUT, capabilities=caps(),
                    config=SimpleNamespace(transport="direct"))
        return SimpleNamespace(**{**base, **kw})

    GraphFFNServer._check_connector(fake(), True, None)  # dedup: no ConfigError any more
    GraphFFNServer._check_connector(fake(layout=LAYOUT), True, None)
    fp8_layout = dataclasses.replace(LAYOUT, dispatch_dtype="fp8_e4m3")  # the gather decodes its rows
    GraphFFNServer._check_connector(fake(layout=fp8_layout, config=SimpleNamespace(
        transport="direct", dispatch_dtype="fp8_e4m3")), True, None)
    with pytest.raises(ConfigError, match="poll_mode='device'"):
        GraphFFNServer._check_connector(fake(capabilities=caps(device_polling=False)), True, None)
    with pytest.raises(ConfigError, match=r"Attention rank\(s\) \[1\] are reached by host-initiated copies "
                                          r"\(transport='auto'\); use FFNWorker"):
        GraphFFNServer._check_connector(fake(capabilities=caps(put_peers=(1,)),
                                             config=SimpleNamespace(transport="auto")), True, None)
    with pytest.raises(ConfigError, match="FFN-side cuda connector"):
        GraphFFNServer._check_connector(fake(capabilities=caps(backend="host")), True, None)
    with pytest.raises(ConfigError, match="exactly one of"):
        GraphFFNServer._check_connector(fake(), True, object())


def test_server_settings_check_depth_timeout_and_the_gemm_sm_carveout(monkeypatch):
    """GraphFFNServer needs a GPU to construct; its knob check runs here (ConfigError with the
    values; the carve-out against the device's SM count, stubbed)."""
    import torch

    from afd_cupy import moe
    from afd_cupy.moe import carveout
    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

    check = GraphFFNServer._check_settings
    monkeypatch.setattr(carveout, "_sm_count", lambda device: 132)
    assert check(4, 0.01, 0, torch.device("cuda", 0)) == 0
    assert check(1, 1, 2, torch.device("cuda", 0)) == 2
    assert check(1, 1, "auto", torch.device("cuda", 0)) == moe.AUTO_GEMM_SM_CARVEOUT
    for args, match in (((0, 0.01, 0), r"depth must be >= 1 and idle_timeout_s > 0, got 0, 0.01"),
                        ((4, 0.0, 0), r"got 4, 0.0"),
                        ((4, 0.01, 132), r"GraphFFNServer.gemm_sm_carveout=132 must be < the SM count "
                                         r"of cuda:0 \(132\)"),
                        ((4, 0.01, -1), r"GraphFFNServer.gemm_sm_carveout must be >= 0, got -1"),
                        ((4, 0.01, "2"), r"GraphFFNServer.gemm_sm_carveout must be 'auto' or an int >= 0 .*got '2'"),
                        ((4, 0.01, 2.5), r"GraphFFNServer.gemm_sm_carveout must be an int >= 0 .*got float 2.5")):
        with pytest.raises(ConfigError, match=match):
            check(*args, torch.device("cuda", 0))


def test_server_expert_gemm_choice(monkeypatch):
    """GraphFFNServer(expert_gemm=...): "grouped_mm" (the default) or "stream" where
    moe.stream_gemm can run (ConfigError naming the value, or its reason, otherwise)."""
    import torch

    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer
    from afd_cupy.moe import stream_gemm

    check = GraphFFNServer._check_expert_gemm
    assert check("grouped_mm", torch.device("cuda", 0)) == "grouped_mm"
    with pytest.raises(ConfigError, match=r"expert_gemm must be one of \('grouped_mm', 'stream'\), got 'triton'"):
        check("triton", torch.device("cuda", 0))
    monkeypatch.setattr(stream_gemm, "unavailable_reason", lambda device: "no CUDA device")
    with pytest.raises(ConfigError, match=r"expert_gemm='stream'\) cannot run on cuda:0: no CUDA device"):
        check("stream", torch.device("cuda", 0))
    monkeypatch.setattr(stream_gemm, "unavailable_reason", lambda device: None)
    assert check("stream", torch.device("cuda", 0)) == "stream"
