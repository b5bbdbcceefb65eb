"""GPU checks of the graph-driven FFN: each kernel of raw_kernels/ffn/ffn_graph_*.cu against the numpy
reference (afd_cupy.ffn.graph.stage_reference, wire's header builders) on fresh random data
with garbage-prefilled outputs; the kernels captured with wait_any in a torch CUDA graph and
replayed; and GraphFFNServer end to end against the fp64 MoE reference (eager fallback
included). Skipped without CuPy / a GPU (conftest)."""
from __future__ import annotations


import numpy as np
import pytest

from afd_cupy import kernels, moe, wire
from afd_cupy.ffn import graph as ffn_graph
from afd_cupy.kernels import specs

from helpers import kernels as kh
from helpers.layouts import kernel_layout, small_layout
from helpers.rng import node_rng, node_seed

cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda
EPR, HIDDEN, NUM_LAYERS = 4, 64, 3


class Stage:
    """An FFN rank's own window (random bytes), the device doorbell wait_any would leave, and
    the stage's buffers pre-filled with garbage."""

    def __init__(self, rng, layout=None, src_rank=1, routed_bucket=24, shared_bucket=8):
        self.rng, self.layout = rng, layout or small_layout(expert_per_rank=EPR, hidden_size=HIDDEN)
        self.src_rank, self.routed_bucket, self.shared_bucket = src_rank, routed_bucket, shared_bucket
        hw = self.layout.header_words
        self.window = cp.asarray(rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8))
        self.doorbell = cp.zeros(wire.DB_HEADER + -(-hw // 2), cp.int64)
        self.routed_offs = cp.full(NUM_LAYERS * EPR, -7, cp.int32)
        self.shared_offs = cp.full(NUM_LAYERS, -7, cp.int32)
        self.reply_seqs = cp.asarray(rng.integers(1, 2**40, self.layout.num_slots))
        self.state = cp.full(ffn_graph.state_words(hw), -7, cp.int64)
        self.replay_counter = cp.asarray(np.array([int(rng.integers(0, 100))]))
        self.record_words = ffn_graph.record_words(hw, dedup=self.layout.is_dedup)
        self.records = kernels.PinnedInt64(4 * self.record_words)
        self.records.array[:] = -9

    def arrive(self, slot, words):
        """What afd_wait_any leaves for an arrival at ``slot`` (None: a timeout)."""
        bell = np.zeros(self.doorbell.size, np.int64)
        bell[wire.DB_STATUS] = wire.STATUS_OK if slot is not None else wire.STATUS_TIMEOUT
        bell[wire.DB_SLOT] = -1 if slot is None else slot
        bell[wire.DB_FLAG] = 0 if slot is None else int(self.rng.integers(1, 2**40))
        if slot is not None:
            bell[wire.DB_HEADER:].view(np.int32)[:len(words)] = words
        self.doorbell.set(bell)

    def launch(self):
        layout = self.layout
        spec = specs.graph_stage_spec(
            doorbell=self.doorbell.data.ptr, geo=layout.kernel_geometry(), expert_per_rank=EPR,
            is_dedup=int(layout.is_dedup), is_fp8=int(layout.is_fp8_dispatch), src_rank=self.src_rank, num_attn_ranks=2, token_cap=layout.token_cap,
            routed_cap=layout.routed_cap, shared_cap=layout.shared_cap,
            routed_bucket=self.routed_bucket, shared_bucket=self.shared_bucket, num_layers=NUM_LAYERS,
            layers_per_chunk=ffn_graph.layers_per_chunk(NUM_LAYERS, EPR), routed_offs=self.routed_offs,
            shared_offs=self.shared_offs.data.ptr, reply_seqs=self.reply_seqs, state=self.state,
            replay_counter=self.replay_counter, records=self.records.ptr, num_records=4,
            record_words=self.record_words)
        return spec

    def wait_stage_spec(self, last_seen, scan_start, counts_snapshot, timeout_ns):
        """afd_graph_wait_stage over this window with the stage buffers of :meth:`launch`."""
        layout = self.layout
        return specs.graph_wait_stage_spec(
            window=self.window.data.ptr, last_seen=last_seen, scan_start=scan_start,
            counts_snapshot=counts_snapshot, timeout_ns=timeout_ns, geo=layout.kernel_geometry(),
            expert_per_rank=EPR, is_dedup=int(layout.is_dedup), is_fp8=int(layout.is_fp8_dispatch), src_rank=self.src_rank, num_attn_ranks=2,
            token_cap=layout.token_cap, routed_cap=layout.routed_cap, shared_cap=layout.shared_cap,
            routed_bucket=self.routed_bucket, shared_bucket=self.shared_bucket, num_layers=NUM_LAYERS,
            layers_per_chunk=ffn_graph.layers_per_chunk(NUM_LAYERS, EPR), routed_offs=self.routed_offs,
            shared_offs=self.shared_offs.data.ptr, reply_seqs=self.reply_seqs, state=self.state,
            replay_counter=self.replay_counter, records=self.records.ptr, num_records=4,
            record_words=self.record_words)

    def record(self, replay: int) -> np.ndarray:
        """A copy of the record of replay number ``replay``."""
        start = (replay % 4) * self.record_words
        return self.records.array[start:start + self.record_words].copy()


def _dispatch_words(rng, *, src=0, layer=1, shared=3, counts=None):
    counts = rng.integers(0, 6, EPR) if counts is None else counts
    header = wire.dispatch_header(seq=int(rng.integers(1, 2**32)), src_rank=src, layer_idx=layer,
                                  stage_idx=int(rng.integers(0, 3)), num_tokens=12, shared_tokens=shared,
                                  top_k=4, expert_counts=counts)
    return wire.encode_header(header, EPR)


CASES = ["served", "idle", "shutdown", "bad_magic", "bad_sum", "wrong_src", "too_large", "layer_out"]


def _case_words(rng, case):
    """(header words, slot) of one stage case: a valid dispatch in region 0, or the change
    the case names."""
    words, slot = _dispatch_words(rng), int(rng.integers(0, 2))  # region 0
    if case == "shutdown":
        words = wire.encode_header(wire.shutdown_header(src_rank=0, top_k=4, expert_per_rank=EPR), EPR)
    elif case == "bad_magic":
        words[wire.HDR_MAGIC] ^= 0x100
    elif case == "bad_sum":
        words[wire.HDR_FIXED_WORDS + 1] += 1
    elif case == "wrong_src":
        slot += 2  # region 1 holds a message claiming rank 0
    elif case == "too_large":
        words = _dispatch_words(rng, counts=np.array([9, 9, 9, 9]))
    elif case == "layer_out":
        words[wire.HDR_LAYER] = NUM_LAYERS
    return words, slot


@pytest.mark.parametrize("case", CASES)
def test_stage_matches_the_reference(request, case):
    rng = node_rng(request)
    st = Stage(rng)
    words, slot = _case_words(rng, case)
    st.arrive(None if case == "idle" else slot, words)
    seqs_before, replay = st.reply_seqs.get(), int(st.replay_counter.get()[0])
    st.launch().launch()
    cp.cuda.runtime.deviceSynchronize()
    _check_stage(st, case, words, None if case == "idle" else slot, seqs_before, replay)


def _check_stage(st, case, words, slot, seqs_before, replay):
    """The stage's outputs (offsets, state, reply seqs, record, replay counter) against
    ffn_graph.stage_reference for ``words`` consumed from ``slot`` (None: nothing arrived)."""
    region = None if slot is None else slot // st.layout.ring_depth
    want = ffn_graph.stage_reference(
        words, region=region, layout=st.layout, src_rank=st.src_rank, num_attn_ranks=2,
        num_layers=NUM_LAYERS, routed_bucket=st.routed_bucket, shared_bucket=st.shared_bucket,
        prev_seq=int(seqs_before[slot]) if region is not None else 0)
    assert want.status == {"served": ffn_graph.GS_SERVED, "idle": ffn_graph.GS_IDLE,
                           "shutdown": ffn_graph.GS_SHUTDOWN, "too_large": ffn_graph.GS_EAGER,
                           "layer_out": ffn_graph.GS_EAGER,
                           "two_arrived": ffn_graph.GS_SERVED}.get(case, ffn_graph.GS_REJECTED)
    np.testing.assert_array_equal(st.routed_offs.get(), want.routed_offs)
    np.testing.assert_array_equal(st.shared_offs.get(), want.shared_offs)
    state = st.state.get()
    assert state[ffn_graph.STATE_ACTIVE] == int(want.status == ffn_graph.GS_SERVED)
    assert state[ffn_graph.STATE_SEQ] == want.seq and state[ffn_graph.STATE_CHUNK] == want.chunk
    seqs = seqs_before.copy()
    if want.seq:
        seqs[slot] = want.seq
    np.testing.assert_array_equal(st.reply_seqs.get(), seqs)
    if want.reply_words is not None:
        got_words = state[ffn_graph.STATE_HEADER:].view(np.int32)[:st.layout.header_words]
        np.testing.assert_array_equal(got_words, want.reply_words)
        assert (state[ffn_graph.STATE_ROUTED], state[ffn_graph.STATE_SHARED]) == (
            int(words[wire.HDR_ROUTED_TOKENS]), int(words[wire.HDR_SHARED_TOKENS]))
    rec_words = ffn_graph.record_words(st.layout.header_words)
    rec = st.records.array[(replay % 4) * rec_words:][:rec_words]
    assert rec[ffn_graph.REC_REPLAY] == replay and rec[ffn_graph.REC_STATUS] == want.status
    assert rec[ffn_graph.REC_SLOT] == (-1 if region is None else slot)
    assert rec[ffn_graph.REC_SEQ] == want.seq
    if region is not None:
        np.testing.assert_array_equal(rec[ffn_graph.REC_HEADER:].view(np.int32)[:len(words)], words)
    if case == "bad_magic":
        assert rec[ffn_graph.REC_DETAIL] == wire.HDR_MAGIC
    assert int(st.replay_counter.get()[0]) == replay + 1
    return rec


def _post(layout, window, slot, words, rng) -> int:
    """A message in ``slot`` of ``window`` (device bytes): its header words, then its flag
    moved on by a random step. Returns the new flag."""
    hdr_at = layout.flags_bytes + slot * layout.slot_bytes + layout.field_offset("header")
    window[hdr_at:hdr_at + words.nbytes] = cp.asarray(words.view(np.uint8))
    flags = window[:layout.num_slots * 8].view(cp.int64)
    flags[slot] = flags[slot] + int(rng.integers(1, 1000))
    return int(flags[slot].get())


@pytest.mark.parametrize("case", CASES + ["two_arrived"])
def test_wait_stage_kernel_is_wait_any_then_the_stage(request, case):
    """afd_graph_wait_stage on a window whose flags are random: nothing new (idle: the bounded
    wait times out, nothing consumed, the record's header words are zero), one arrival, or two
    (the first after scan_start in rotated order wins). Its wait side effects (last_seen,
    scan_start, the won slot's counts_snapshot row) are afd_wait_any's; its stage outputs are
    ffn_graph.stage_reference's for the won header."""
    rng = node_rng(request)
    st = Stage(rng)
    layout = st.layout
    num_slots = layout.num_slots
    last_seen = st.window[:num_slots * 8].view(cp.int64).copy()  # every flag seen
    start = int(rng.integers(0, num_slots))
    scan_start = cp.asarray(np.array([start], np.int32))
    snapshot = cp.full((num_slots, EPR), -7, cp.int32)
    words, slot = _case_words(rng, case)
    posted = {}
    if case != "idle":
        posted[slot] = (words, _post(layout, st.window, slot, words, rng))
    if case == "two_arrived":  # the other ring of region 0
        other = 1 - slot
        other_words = _dispatch_words(rng)
        posted[other] = (other_words, _post(layout, st.window, other, other_words, rng))
    seen_before, seqs_before = last_seen.get(), st.reply_seqs.get()
    replay = int(st.replay_counter.get()[0])
    st.wait_stage_spec(last_seen, scan_start, snapshot, 50_000).launch()
    cp.cuda.runtime.deviceSynchronize()
    rotated = [(start + i) % num_slots for i in range(num_slots)]
    won = next((s for s in rotated if s in posted), None)
    if won is None:
        rec = _check_stage(st, case, words, None, seqs_before, replay)
        assert not rec[ffn_graph.REC_HEADER:].view(np.int32)[:layout.header_words].any()
        np.testing.assert_array_equal(last_seen.get(), seen_before)
        assert int(scan_start.get()[0]) == start and (snapshot.get() == -7).all()
        return
    won_words, won_flag = posted[won]
    _check_stage(st, case, won_words, won, seqs_before, replay)
    seen = seen_before.copy()
    seen[won] = won_flag
    np.testing.assert_array_equal(last_seen.get(), seen)
    assert int(scan_start.get()[0]) == (won + 1) % num_slots
    want_snapshot = np.full((num_slots, EPR), -7, np.int32)
    want_snapshot[won] = won_words[wire.HDR_FIXED_WORDS:]
    np.testing.assert_array_equal(snapshot.get(), want_snapshot)


def _slot_rows(layout, window_bytes, slot, field, rows):
    start = layout.flags_bytes + slot * layout.slot_bytes + layout.field_offset(field)
    return window_bytes[start:start + rows * HIDDEN * 2].view(np.uint16).reshape(rows, HIDDEN)


@pytest.mark.parametrize("identity", [False, True])
def test_gather_and_reply_move_exactly_the_served_rows(request, identity):
    rng = node_rng(request)
    st = Stage(rng)
    layout = st.layout
    words, slot = _dispatch_words(rng, layer=2, counts=np.array([3, 0, 5, 2]), shared=4), 1
    st.arrive(slot, words)
    st.launch().launch()
    # gather: staging pre-filled with 0xFFFF (a NaN bf16), only the served rows change
    staging = cp.full((st.routed_bucket, HIDDEN), 0xFFFF, cp.uint16)
    shared_staging = cp.full((st.shared_bucket, HIDDEN), 0xFFFF, cp.uint16)
    specs.graph_gather_spec(dtype_code=0, window=st.window.data.ptr, geo=layout.kernel_geometry(),
                            state=st.state, hidden_size=HIDDEN, routed_staging=staging.data.ptr,
                            shared_staging=shared_staging.data.ptr, routed_bucket=st.routed_bucket,
                            shared_bucket=st.shared_bucket).launch()
    own = st.window.get()
    want_staging = np.full((st.routed_bucket, HIDDEN), 0xFFFF, np.uint16)
    want_staging[:10] = _slot_rows(layout, own, slot, "routed_x", 10)
    np.testing.assert_array_equal(staging.get(), want_staging)
    np.testing.assert_array_equal(shared_staging.get()[:4], _slot_rows(layout, own, slot, "shared_x", 4))
    assert (shared_staging.get()[4:] == 0xFFFF).all()
    # reply: outputs of chunk 0 (random), into the Attention peer's window (random bytes)
    peer_prefill = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    peer = cp.asarray(peer_prefill)
    routed_out = cp.asarray(rng.integers(0, 2**16, (st.routed_bucket, HIDDEN), dtype=np.uint16))
    shared_out = cp.asarray(rng.integers(0, 2**16, (st.shared_bucket, HIDDEN), dtype=np.uint16))
    routed_outs = cp.asarray(np.array([0 if identity else routed_out.data.ptr], np.uint64))
    peer_windows = cp.asarray(np.array([peer.data.ptr, 0], np.uint64))
    specs.graph_reply_spec(
        dtype_code=0, own_window=st.window.data.ptr, peer_windows=peer_windows,
        geo=layout.kernel_geometry(), src_rank=st.src_rank, state=st.state, routed_outs=routed_outs,
        shared_out=0 if identity else shared_out.data.ptr, hidden_size=HIDDEN,
        done_counter=cp.zeros(1, cp.uint32), routed_bucket=st.routed_bucket,
        shared_bucket=st.shared_bucket).launch()
    cp.cuda.runtime.deviceSynchronize()
    got = peer.get()
    want = peer_prefill.copy()
    dst_slot = layout.slot_index(st.src_rank, slot % layout.ring_depth)
    seq = int(st.state.get()[ffn_graph.STATE_SEQ])
    want[dst_slot * 8:dst_slot * 8 + 8] = np.array([seq], np.int64).view(np.uint8)
    header = wire.reply_header(wire.decode_header(words, EPR), seq=seq, src_rank=st.src_rank)
    hdr_at = layout.flags_bytes + dst_slot * layout.slot_bytes + layout.field_offset("header")
    want[hdr_at:hdr_at + 4 * layout.header_words] = wire.encode_header(header, EPR).view(np.uint8)
    routed_src = _slot_rows(layout, own, slot, "routed_x", 10) if identity else routed_out.get()[:10]
    shared_src = _slot_rows(layout, own, slot, "shared_x", 4) if identity else shared_out.get()[:4]
    _slot_rows(layout, want, dst_slot, "routed_x", 10)[:] = routed_src
    _slot_rows(layout, want, dst_slot, "shared_x", 4)[:] = shared_src
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fused", [True, False], ids=["wait_stage", "wait_any+stage"])
def test_wait_stage_reply_replayed_from_a_cuda_graph(request, fused):
    """wait + stage (afd_graph_wait_stage, or wait_any into a device doorbell and the stage) ->
    reply captured on torch's capture stream through PackedLaunch, replayed: an idle replay
    times out and records IDLE; an arrival is answered."""
    rng = node_rng(request)
    st = Stage(rng)
    layout = st.layout
    geo = layout.kernel_geometry()
    last_seen = st.window[:layout.num_slots * 8].view(cp.int64).copy()
    scan_start, snapshot = cp.zeros(1, cp.int32), cp.zeros((layout.num_slots, EPR), cp.int32)
    wait = kernels.PackedLaunch(kernels.wait_any_spec(
        window=st.window.data.ptr, geo=geo, last_seen=last_seen, scan_start=scan_start,
        counts_snapshot=snapshot, timeout_ns=20_000_000, doorbell=st.doorbell.data.ptr, ticket=0))
    stage = kernels.PackedLaunch(st.launch())
    first = [wait, stage]
    if fused:
        first = [kernels.PackedLaunch(st.wait_stage_spec(last_seen, scan_start, snapshot, 20_000_000))]
    peer = cp.zeros(layout.window_bytes, cp.uint8)
    reply = kernels.PackedLaunch(specs.graph_reply_spec(
        dtype_code=0, own_window=st.window.data.ptr,
        peer_windows=cp.asarray(np.array([peer.data.ptr, 0], np.uint64)), geo=geo,
        src_rank=st.src_rank, state=st.state, routed_outs=cp.zeros(1, cp.uint64), shared_out=0,
        hidden_size=HIDDEN, done_counter=cp.zeros(1, cp.uint32), routed_bucket=st.routed_bucket,
        shared_bucket=st.shared_bucket))
    cp.cuda.runtime.deviceSynchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        ptr = torch.cuda.current_stream().cuda_stream
        for launch in (*first, reply):
            launch.launch(ptr)
    replay = int(st.replay_counter.get()[0])  # capture ran nothing
    rec_words = ffn_graph.record_words(layout.header_words)
    graph.replay()
    torch.cuda.synchronize()
    assert st.records.array[(replay % 4) * rec_words + ffn_graph.REC_STATUS] == ffn_graph.GS_IDLE
    assert not peer.get().any()
    slot = 1
    _post(layout, st.window, slot, _dispatch_words(rng), rng)
    cp.cuda.runtime.deviceSynchronize()
    graph.replay()
    torch.cuda.synchronize()
    rec = st.records.array[((replay + 1) % 4) * rec_words:][:rec_words]
    assert rec[ffn_graph.REC_REPLAY] == replay + 1 and rec[ffn_graph.REC_STATUS] == ffn_graph.GS_SERVED
    dst_slot = layout.slot_index(st.src_rank, slot % layout.ring_depth)
    assert peer.get()[dst_slot * 8:dst_slot * 8 + 8].view(np.int64)[0] == rec[ffn_graph.REC_SEQ]


@pytest.mark.parametrize("num_layers", [1, 3])
def test_graph_server_matches_the_reference_with_an_eager_fallback(num_layers):
    """1A1F: layers of 4, 16, 40 and 1 tokens; buckets (4, 16): the 40-token layers run eagerly
    (reply seq reserved on the device), every output within the fp64 reference's tolerance; the
    layer is chosen on the device (stacked weights, zero-size groups elsewhere)."""
    from afd_cupy.config import ModelConfig
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_rank
    from afd_cupy.testing.scenario import Scenario, tolerance

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the graph FFN's GEMM mode needs torch._grouped_mm on SM90/SM100")
    layers = 4 * num_layers
    tokens = tuple(([4, 16, 40, 1] * num_layers)[:layers])
    model = ModelConfig(hidden_size=128, num_experts=8, top_k=2, moe_intermediate_size=64,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64,
                        num_layers=layers, routed_scaling_factor=2.5)
    scenario = Scenario(model, 1, 1, backend="cuda", tokens=(tokens,))
    attn, ffn = launch(run_graph_rank, 2, args=(scenario, (4, 16)), timeout_s=240)
    assert len(attn["errors"]) == layers
    for err in attn["errors"]:
        assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= tolerance("bfloat16"), err
    # the 40-token items never fit; a 16-token item may meet a replay of the small bucket
    # queued before the policy moved up
    assert ffn["served"] == layers
    assert tokens.count(40) <= ffn["eager"] <= tokens.count(40) + tokens.count(16)


@pytest.mark.parametrize("fp8", [False, True])
def test_graph_server_with_the_streamed_expert_gemms_matches_the_reference(fp8):
    """GraphFFNServer(expert_gemm="stream") (moe.stream_gemm's Triton kernels on the stacked
    layers, decision 0032): layers of 4, 16, 40 and 1 tokens, a 40-token layer eager (the eager
    path keeps moe.grouped_mlp), every output within the fp64 reference's tolerance; with FP8
    routed experts (block-scaled, stacked with their scales) within the FP8 budget of the
    bf16 reference instead."""
    from afd_cupy.config import ModelConfig
    from afd_cupy.moe import stream_gemm
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_rank
    from afd_cupy.testing.scenario import Scenario, tolerance

    reason = stream_gemm.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    tokens = (4, 16, 40, 1, 16, 4)
    model = ModelConfig(hidden_size=256, num_experts=8, top_k=2, moe_intermediate_size=192,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64,
                        num_layers=len(tokens), routed_scaling_factor=2.5)
    scenario = Scenario(model, 1, 1, backend="cuda", tokens=(tokens,))
    attn, ffn = launch(run_graph_rank, 2, args=(scenario, (4, 16), "stream", fp8), timeout_s=240)
    assert ffn["served"] == len(tokens) and ffn["expert_gemm"] == "stream" and ffn["eager"] >= 1
    assert len(attn["errors"]) == len(tokens)
    bound = 0.1 if fp8 else tolerance("bfloat16")  # E4M3 weights: a few per cent (docs/design/fp8.md)
    for err in attn["errors"]:
        assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= bound, err


def test_graph_server_gemm_sm_carveout_gives_the_same_outputs():
    """GraphFFNServer(gemm_sm_carveout="auto"), the default (2 SMs left free on a GPU): the
    GEMMs captured with the carve-out answer every layer exactly as with 0 (one bucket that holds every item: no
    eager fallback, no bucket change; routed and shared experts are both torch._grouped_mm,
    whose persistent kernel computes each tile the same way whatever its grid). Intermediate
    1408: the gate/up GEMMs have more tiles than an H200 has SMs."""
    from afd_cupy.config import ModelConfig
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_rank
    from afd_cupy.testing.scenario import Scenario, tolerance

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the graph FFN's GEMM mode needs torch._grouped_mm on SM90/SM100")
    tokens = (4, 16, 1, 16)
    model = ModelConfig(hidden_size=128, num_experts=8, top_k=2, moe_intermediate_size=1408,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=16,
                        num_layers=len(tokens), routed_scaling_factor=2.5)
    runs = []
    for carveout, resolved in ((0, 0), ("auto", moe.AUTO_GEMM_SM_CARVEOUT)):
        scenario = Scenario(model, 1, 1, backend="cuda", tokens=(tokens,), gemm_sm_carveout=carveout)
        attn, ffn = launch(run_graph_rank, 2, args=(scenario, (16,)), timeout_s=240)
        assert ffn["served"] == len(tokens) and ffn["eager"] == 0 and ffn["gemm_sm_carveout"] == resolved
        for err in attn["errors"]:
            assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= tolerance("bfloat16"), err
        runs.append([(err["layer"], err["rel_err"]) for err in attn["errors"]])
    assert runs[1] == runs[0]


# --------------------------------------------------------------------------- dedup wire mode
# afd_graph_dedup_expand / afd_graph_dedup_reply against ffn_graph.dedup_expand_reference /
# dedup_reply_reference (built on afd_cupy.testing.dedup_reference), each run after the real
# stage kernel on a dedup header, on fresh random routings, outputs pre-filled with NaN words
# and guard rows that must stay untouched.
from test_kernels_cuda import (NAN_WORD, RAW, assert_window_equal, put, random_rows,  # noqa: E402
                               to_f32, to_raw)

from afd_cupy.errors import WireError  # noqa: E402
from afd_cupy.testing import dedup_reference as dref  # noqa: E402

UNCLAIMED = 0x7FFFFFFF
GUARD_ROWS = 3
COPY_CANARY = -7
DEDUP_SRC, DEDUP_FFN_RANK, DEDUP_RING = 0, 1, 1  # Attention rank 0 -> FFN rank 1 (= st.src_rank)


def _dedup_layout(dtype="bfloat16", hidden=HIDDEN, token_cap=16, top_k=4):
    return kernel_layout(num_regions=2, epr=EPR, hidden=hidden, dtype=dtype, top_k=top_k,
                         token_cap=token_cap, routed_cap=token_cap * top_k, has_shared=True,
                         wire_mode="dedup")


class DedupItem:
    """FFN rank 1's dedup message from Attention rank 0 (numpy references: plan, scatter) for a
    fresh random routing over F = 2 ranks of EPR experts, written into slot (0, DEDUP_RING) of
    the Stage's own window (random bytes elsewhere), and the stage run on its arrival."""

    def __init__(self, rng, st: Stage, *, dtype, num_tokens, has_shared=True, corrupt=None):
        layout = self.layout = st.layout
        top_k, hidden = layout.top_k, layout.hidden_size
        ids = np.stack([rng.permutation(2 * EPR)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
        weights = (rng.random((num_tokens, top_k)) + 0.05).astype(np.float32)
        plan = dref.plan_reference(ids, 2, EPR, has_shared=has_shared)
        self.table, self.rows = dref.scatter_reference(plan, random_rows(rng, num_tokens, hidden, dtype),
                                                       ids, weights, DEDUP_FFN_RANK)
        self.num_tokens, self.num_rows = num_tokens, int(plan.num_rows[DEDUP_FFN_RANK])
        self.routed = plan.routed_count(DEDUP_FFN_RANK)
        self.shared = int(plan.shared_rows[DEDUP_FFN_RANK])
        self.header = wire.dispatch_header(
            seq=int(rng.integers(1, 2**31)), src_rank=DEDUP_SRC, layer_idx=int(rng.integers(0, NUM_LAYERS)),
            stage_idx=0, num_tokens=num_tokens, shared_tokens=self.shared, top_k=top_k,
            expert_counts=tuple(int(c) for c in plan.rank_counts(DEDUP_FFN_RANK)), wire_mode="dedup",
            num_rows=self.num_rows)
        self.words = wire.encode_header(self.header, EPR)
        self.corrupt_row = None
        if corrupt is not None:
            self.table = self.table.copy()
            self.corrupt_row = kh.ROUTE_TABLE_FAULTS[corrupt](
                self.table, num_tokens=num_tokens, shared_tokens=self.shared, routed_tokens=self.routed)
        self.slot = layout.slot_index(DEDUP_SRC, DEDUP_RING)
        base = layout.slot_offset(DEDUP_SRC, DEDUP_RING)
        window = st.window.get()
        put(window, base + layout.field_offset("header"), self.words)
        put(window, base + layout.field_offset("route_table"), self.table)
        put(window, base + layout.field_offset("routed_x"), self.rows)
        st.window = cp.asarray(window)
        self.window_np = window
        self.seqs_before = st.reply_seqs.get()
        self.replay = int(st.replay_counter.get()[0])
        st.arrive(self.slot, self.words)
        st.launch().launch()
        cp.cuda.runtime.deviceSynchronize()


class DedupScratch:
    """What GraphFFNServer allocates for the dedup expand (staging with guard rows)."""

    def __init__(self, layout, dtype, *, routed_bucket, shared_bucket):
        raw, hidden = RAW[dtype], layout.hidden_size
        self.dtype = dtype
        self.staging = cp.full((routed_bucket + GUARD_ROWS, hidden), NAN_WORD[dtype], raw)
        self.shared = cp.full((shared_bucket + GUARD_ROWS, hidden), NAN_WORD[dtype], raw)
        self.route_copy = cp.full((layout.token_cap, layout.route_width), COPY_CANARY, cp.int32)
        self.claims = cp.full(layout.routed_cap, UNCLAIMED, cp.int32)
        self.fault = cp.full(1, np.iinfo(np.uint64).max, cp.uint64)
        self.num_claimed = cp.zeros(1, cp.uint32)
        self.done = cp.zeros(1, cp.uint32)

    def expand(self, st: Stage, *, identity=False, rows_bucket=16):
        layout = st.layout
        specs.graph_dedup_expand_spec(
            dtype_code=kernels.DTYPE_CODES[self.dtype], window=st.window.data.ptr,
            geo=layout.kernel_geometry(), state=st.state, top_k=layout.top_k,
            hidden_size=layout.hidden_size, routed_staging=0 if identity else self.staging.data.ptr,
            shared_staging=0 if identity else self.shared.data.ptr, route_copy=self.route_copy,
            claims=self.claims, fault=self.fault, num_claimed=self.num_claimed, reply_seqs=st.reply_seqs,
            done_counter=self.done, token_cap=layout.token_cap, routed_cap=layout.routed_cap,
            rows_bucket=rows_bucket).launch()
        cp.cuda.runtime.deviceSynchronize()

    def assert_scratch_reset(self):
        assert (self.claims.get() == UNCLAIMED).all()
        assert int(self.fault.get()[0]) == np.iinfo(np.uint64).max
        assert int(self.num_claimed.get()[0]) == 0 and int(self.done.get()[0]) == 0


def _dedup_stage(rng, dtype="bfloat16", hidden=HIDDEN, token_cap=16):
    layout = _dedup_layout(dtype, hidden, token_cap)
    return Stage(rng, layout, src_rank=DEDUP_FFN_RANK, routed_bucket=layout.routed_cap,
                 shared_bucket=layout.shared_cap)


@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("rows_bucket", [16, 1])  # 1: one block strides over every row
@pytest.mark.parametrize("dtype,hidden,num_tokens,has_shared",
                         [("bfloat16", 64, 16, True), ("float16", 33, 9, False), ("float32", 50, 1, True)])
def test_graph_dedup_expand_matches_the_reference(request, dtype, hidden, num_tokens, has_shared,
                                                  rows_bucket, identity):
    rng = node_rng(request)
    st = _dedup_stage(rng, dtype, hidden)
    item = DedupItem(rng, st, dtype=dtype, num_tokens=num_tokens, has_shared=has_shared)
    assert st.record(item.replay)[ffn_graph.REC_STATUS] == ffn_graph.GS_SERVED
    scratch = DedupScratch(st.layout, dtype, routed_bucket=st.routed_bucket, shared_bucket=st.shared_bucket)
    scratch.expand(st, identity=identity, rows_bucket=rows_bucket)
    verdict, staging, shared = ffn_graph.dedup_expand_reference(
        item.table, item.rows, num_tokens=num_tokens, routed_tokens=item.routed, shared_tokens=item.shared)
    assert verdict is None
    got, got_shared = scratch.staging.get(), scratch.shared.get()
    if identity:  # check and copy only
        assert (got == NAN_WORD[dtype]).all() and (got_shared == NAN_WORD[dtype]).all()
    else:
        np.testing.assert_array_equal(got[:item.routed], staging)
        assert (got[item.routed:] == NAN_WORD[dtype]).all(), "staging rows past P written"
        np.testing.assert_array_equal(got_shared[:item.shared], shared)
        assert (got_shared[item.shared:] == NAN_WORD[dtype]).all(), "shared rows past S written"
    copy = scratch.route_copy.get()
    np.testing.assert_array_equal(copy[:item.num_rows], item.table)
    assert (copy[item.num_rows:] == COPY_CANARY).all()
    scratch.assert_scratch_reset()
    assert_window_equal(st.window.get(), item.window_np, st.layout, "expand wrote its window")
    rec = st.record(item.replay)
    assert rec[ffn_graph.REC_STATUS] == ffn_graph.GS_SERVED and rec[ffn_graph.REC_SEQ] == item.seqs_before[item.slot] + 1
    state = st.state.get()
    assert state[ffn_graph.STATE_ACTIVE] == 1
    assert st.reply_seqs.get()[item.slot] == item.seqs_before[item.slot] + 1


@pytest.mark.parametrize("fault", sorted(kh.ROUTE_TABLE_FAULTS))
def test_graph_dedup_expand_rejects_each_bad_route_table(request, fault):
    """GS_BAD_ROUTE with the model's verdict in the record, decoded to the eager path's WireError
    (same words); the reserved reply seq is given back and the reply writes nothing; the scratch
    is reusable: a valid item expands right after."""
    def corrupted(rng):  # the first seed at or after the test id's whose table takes the fault
        st = _dedup_stage(rng, token_cap=48)
        item = DedupItem(rng, st, dtype="bfloat16", num_tokens=40, corrupt=fault)
        return None if item.corrupt_row is None else (st, item)

    rng, (st, item) = kh.first_seed_taking(corrupted, node_seed(request),
                                           what=f"a table that takes fault {fault}")
    scratch = DedupScratch(st.layout, "bfloat16", routed_bucket=st.routed_bucket, shared_bucket=st.shared_bucket)
    scratch.expand(st, rows_bucket=8)
    verdict, _, _ = ffn_graph.dedup_expand_reference(
        item.table, item.rows, num_tokens=40, routed_tokens=item.routed, shared_tokens=item.shared)
    rule, row, column, expected, observed = verdict
    assert row == item.corrupt_row
    rec = st.record(item.replay)
    assert rec[ffn_graph.REC_STATUS] == ffn_graph.GS_BAD_ROUTE and rec[ffn_graph.REC_SEQ] == 0
    start = ffn_graph.verdict_offset(st.layout.header_words)
    want = wire.StatusRecord(wire.STATUS_BAD_HEADER, DEDUP_SRC, column, DEDUP_RING, expected, observed,
                             row, rule, item.header.layer_idx)
    assert wire.StatusRecord.decode(rec[start:start + wire.STATUS_WORDS]) == want
    err = ffn_graph.route_verdict(rec, st.layout)
    assert isinstance(err, WireError)
    assert str(err) == str(wire.route_table_error(want, shared_tokens=item.shared))
    np.testing.assert_array_equal(st.reply_seqs.get(), item.seqs_before)  # the reservation went back
    assert st.state.get()[ffn_graph.STATE_ACTIVE] == 0
    np.testing.assert_array_equal(scratch.route_copy.get()[:item.num_rows], item.table)
    scratch.assert_scratch_reset()
    # the reply of this replay writes nothing into the sender's window
    peer_prefill = rng.integers(0, 256, st.layout.window_bytes, dtype=np.uint8)
    peer = cp.asarray(peer_prefill)
    _dedup_reply(st, scratch, peer, routed_outs=np.zeros(1, np.uint64), shared_out=0)
    np.testing.assert_array_equal(peer.get(), peer_prefill)
    # a valid item right after, the same scratch
    good = DedupItem(rng, st, dtype="bfloat16", num_tokens=40)
    scratch.expand(st, rows_bucket=8)
    assert st.record(good.replay)[ffn_graph.REC_STATUS] == ffn_graph.GS_SERVED
    np.testing.assert_array_equal(scratch.staging.get()[:good.routed],
                                  dref.expand_reference(good.table, good.rows, good.routed))
    scratch.assert_scratch_reset()


def _dedup_reply(st: Stage, scratch: DedupScratch, peer, *, routed_outs, shared_out, rows_bucket=16):
    layout = st.layout
    specs.graph_dedup_reply_spec(
        dtype_code=kernels.DTYPE_CODES[scratch.dtype], own_window=st.window.data.ptr,
        peer_windows=cp.asarray(np.array([peer.data.ptr, 0], np.uint64)), geo=layout.kernel_geometry(),
        src_rank=st.src_rank, state=st.state, route_copy=scratch.route_copy, top_k=layout.top_k,
        routed_outs=cp.asarray(routed_outs), shared_out=shared_out, hidden_size=layout.hidden_size,
        done_counter=scratch.done, token_cap=layout.token_cap, rows_bucket=rows_bucket,
        num_chunks=len(routed_outs)).launch()
    cp.cuda.runtime.deviceSynchronize()


@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("rows_bucket", [16, 1])
@pytest.mark.parametrize("dtype,hidden,num_tokens,has_shared",
                         [("bfloat16", 64, 16, True), ("float16", 33, 7, True), ("float32", 50, 12, False),
                          ("bfloat16", 4096, 5, True)])  # 8 KiB rows: two warps per row
def test_graph_dedup_reply_lands_exactly(request, dtype, hidden, num_tokens, has_shared, rows_bucket,
                                         identity):
    """Reply rows = dedup_reply_reference rounded once (bitwise: no FMA on either side), header
    words (wire.reply_header, num_rows included) and flag = the reserved seq; every other byte of
    the Attention window untouched. GEMM mode reads the arrived chunk's output (random rows)."""
    rng = node_rng(request)
    st = _dedup_stage(rng, dtype, hidden)
    item = DedupItem(rng, st, dtype=dtype, num_tokens=num_tokens, has_shared=has_shared)
    scratch = DedupScratch(st.layout, dtype, routed_bucket=st.routed_bucket, shared_bucket=st.shared_bucket)
    scratch.expand(st, identity=identity)
    layout = st.layout
    routed_out = random_rows(rng, st.routed_bucket, hidden, dtype)
    shared_out = random_rows(rng, st.shared_bucket, hidden, dtype)
    routed_dev, shared_dev = cp.asarray(routed_out), cp.asarray(shared_out)
    assert st.state.get()[ffn_graph.STATE_CHUNK] == 0  # NUM_LAYERS * EPR groups: one chunk
    routed_outs = np.array([0 if identity else routed_dev.data.ptr], np.uint64)
    prefill = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    dst_base = layout.slot_offset(st.src_rank, DEDUP_RING)
    put(prefill, dst_base + layout.field_offset("routed_x"),
        np.full((item.num_rows, hidden), NAN_WORD[dtype], RAW[dtype]))  # an unwritten row stays NaN
    peer = cp.asarray(prefill)
    _dedup_reply(st, scratch, peer, routed_outs=routed_outs,
                 shared_out=0 if identity else shared_dev.data.ptr, rows_bucket=rows_bucket)
    if identity:
        rows = ffn_graph.dedup_reply_reference(
            item.table, None, None, rows=to_f32(item.rows, dtype).reshape(item.num_rows, hidden))
    else:
        rows = ffn_graph.dedup_reply_reference(
            item.table, to_f32(routed_out, dtype).reshape(-1, hidden),
            to_f32(shared_out, dtype).reshape(-1, hidden))
    seq = int(st.state.get()[ffn_graph.STATE_SEQ])
    assert seq == item.seqs_before[item.slot] + 1
    want = prefill.copy()
    put(want, layout.slot_index(st.src_rank, DEDUP_RING) * 8, np.int64(seq))
    reply = wire.reply_header(item.header, seq=seq, src_rank=st.src_rank)
    put(want, dst_base + layout.field_offset("header"), wire.encode_header(reply, EPR))
    put(want, dst_base + layout.field_offset("routed_x"), to_raw(rows, dtype))
    assert_window_equal(peer.get(), want, layout, "graph dedup reply")
    assert int(scratch.done.get()[0]) == 0
    decoded = wire.decode_header(
        peer.get()[dst_base + layout.field_offset("header"):][:4 * layout.header_words].view(np.int32).copy(),
        EPR, layout)
    assert decoded.is_dedup and decoded.num_rows == item.num_rows and decoded.echo_seq == item.header.seq


def test_graph_dedup_stage_sends_items_past_the_bucket_eager(request):
    """A dedup item with more shared rows (or partials) than the bucket holds is EAGER: the seq is
    reserved, the expand and the reply do nothing."""
    rng = node_rng(request)
    layout = _dedup_layout()
    st = Stage(rng, layout, src_rank=DEDUP_FFN_RANK, routed_bucket=layout.routed_cap, shared_bucket=2)
    item = DedupItem(rng, st, dtype="bfloat16", num_tokens=16)
    assert item.shared > 2
    rec = st.record(item.replay)
    assert rec[ffn_graph.REC_STATUS] == ffn_graph.GS_EAGER
    assert rec[ffn_graph.REC_SEQ] == item.seqs_before[item.slot] + 1
    scratch = DedupScratch(layout, "bfloat16", routed_bucket=layout.routed_cap, shared_bucket=2)
    scratch.expand(st)
    assert (scratch.staging.get() == NAN_WORD["bfloat16"]).all()
    assert (scratch.route_copy.get() == COPY_CANARY).all()
    peer_prefill = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    peer = cp.asarray(peer_prefill)
    _dedup_reply(st, scratch, peer, routed_outs=np.zeros(1, np.uint64), shared_out=0)
    np.testing.assert_array_equal(peer.get(), peer_prefill)


# --- the server end to end in the dedup wire mode ----------------------------------------------
@pytest.mark.parametrize("num_ffn,num_layers", [(1, 1), (1, 3), (2, 3)])
def test_graph_server_dedup_matches_the_reference_with_an_eager_fallback(num_ffn, num_layers):
    """Dedup wire mode, bf16 experts over 4 / 12 layers: layers of 4, 16, 40 and 1 tokens;
    buckets (4, 16): a 40-token item never fits (some rank gets > 32 partials) and is served
    by the eager dedup worker (expand + reduce on the second stream); every output within the
    fp64 reference's tolerance. 1A2F: the shared rule and the partial rows of two ranks."""
    from afd_cupy.config import ConnectorConfig, ModelConfig
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_rank
    from afd_cupy.testing.scenario import Scenario, tolerance

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the graph FFN's GEMM mode needs torch._grouped_mm on SM90/SM100")
    layers = 4 * num_layers
    tokens = tuple(([4, 16, 40, 1] * num_layers)[:layers])
    model = ModelConfig(hidden_size=128, num_experts=8, top_k=2, moe_intermediate_size=64,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64,
                        num_layers=layers, routed_scaling_factor=2.5)
    scenario = Scenario(model, 1, num_ffn, backend="cuda", tokens=(tokens,),
                        connector=ConnectorConfig(wire_mode="dedup"))
    attn, *ffns = launch(run_graph_rank, 1 + num_ffn, args=(scenario, (4, 16)), timeout_s=240)
    assert len(attn["errors"]) == layers
    for err in attn["errors"]:
        assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= tolerance("bfloat16"), err
    eager = sum(ffn["eager"] for ffn in ffns)
    assert eager >= tokens.count(40), ffns
    if num_ffn == 1:  # every token on the one rank: every layer is one item
        assert ffns[0]["served"] == layers
        assert eager <= tokens.count(40) + tokens.count(16)


@pytest.mark.parametrize("wire_mode,corrupt_first", [("dedup", True), ("dedup", False), ("pair", False)])
def test_graph_server_identity_and_a_corrupt_route_table(wire_mode, corrupt_first):
    """Identity experts (no GEMMs), 1A1F, layers of 1..64 tokens: every output is
    (sum_k w_k + 1) * x. corrupt_first: a dedup message whose route table names staging row 0
    twice is rejected inside the graph: the server raises the eager path's WireError (the
    device's duplicate verdict, naming the row), gives the reply seq back and then serves the
    real layers (their replies answer them: the seq bookkeeping is intact)."""
    from afd_cupy.config import ModelConfig
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_identity_rank

    model = ModelConfig(hidden_size=256, num_experts=16, top_k=4, moe_intermediate_size=64,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64, num_layers=3)
    tokens = (1, 5, 64, 17, 32, 1, 64)
    attn, ffn = launch(run_graph_identity_rank, 2, args=(model, wire_mode, tokens, corrupt_first),
                       timeout_s=180)
    assert len(attn["errors"]) == len(tokens)
    for err in attn["errors"]:
        assert err["num_nan"] == 0 and err["rel_err"] <= 2e-2, err
    assert ffn["served"] == len(tokens) and ffn["eager"] == 0
    if corrupt_first:
        assert ffn["error"] is not None
        assert ("dedup dispatch from attention rank 0 (ring 0)" in ffn["error"]
                and "route table row 1: staging row 0 (slot 0) is also named by row 0" in ffn["error"]), ffn
    else:
        assert ffn["error"] is None


# --------------------------------------------------------------------------- FP8 dispatch rows
def _fp8_stage(rng, dtype, *, sender_fp8=True):
    """A served FP8 dispatch (pair mode, H = 256) in slot 1 of an FP8 connector's window: its
    header staged (is_fp8=1) and its 10 routed + 4 shared FP8 wire rows written into the slot,
    quantized by ``wire.fp8`` from fp32 rows of spread magnitudes. Returns (stage, fp32 rows,
    wire rows)."""
    from afd_cupy.wire import fp8

    hidden = 256
    layout = small_layout(expert_per_rank=EPR, hidden_size=hidden, dispatch_dtype="fp8_e4m3",
                          itemsize=2)
    st = Stage(rng, layout=layout)
    header = wire.dispatch_header(seq=int(rng.integers(1, 2**31)), src_rank=0, layer_idx=2, stage_idx=0,
                                  num_tokens=12, shared_tokens=4, top_k=4, expert_counts=(3, 0, 5, 2),
                                  fp8=sender_fp8)
    st.arrive(1, wire.encode_header(header, EPR))
    st.launch().launch()
    groups = hidden // wire.FP8_GROUP
    x = rng.standard_normal((14, hidden)) * np.repeat(2.0 ** rng.integers(-6, 6, (14, groups)), wire.FP8_GROUP, 1)
    x[3, :wire.FP8_GROUP] = 0.0  # an all-zero group: scale 0, decodes to zeros
    rows = fp8.quantize_wire_rows(x.astype(np.float32))
    row_bytes = fp8.fp8_row_bytes(hidden)
    slot_at = layout.flags_bytes + 1 * layout.slot_bytes
    for field, first, count in (("routed_x", 0, 10), ("shared_x", 10, 4)):
        start = slot_at + layout.field_offset(field)
        st.window[start:start + count * row_bytes] = cp.asarray(rows[first:first + count].reshape(-1))
    return st, x, rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gather_decodes_fp8_dispatch_rows_bit_for_bit(request, dtype):
    """afd_graph_gather(fp8_rows=1): the staging rows are wire.fp8's decode of the slot's FP8
    rows rounded to the payload dtype, bit for bit; rows past the item's stay as prefilled."""
    from afd_cupy.wire import fp8
    from afd_cupy.wire.dtypes import f32_to_raw

    rng = node_rng(request)
    st, _, rows = _fp8_stage(rng, dtype)
    hidden = st.layout.hidden_size
    assert st.state.get()[ffn_graph.STATE_ACTIVE] == 1, "the stage serves an FP8 dispatch"
    staging = cp.full((st.routed_bucket, hidden), 0x7FFF, cp.uint16)
    shared_staging = cp.full((st.shared_bucket, hidden), 0x7FFF, cp.uint16)
    specs.graph_gather_spec(dtype_code=kh.dtype_code(dtype), window=st.window.data.ptr,
                            geo=st.layout.kernel_geometry(), state=st.state, hidden_size=hidden,
                            routed_staging=staging.data.ptr, shared_staging=shared_staging.data.ptr,
                            routed_bucket=st.routed_bucket, shared_bucket=st.shared_bucket, fp8_rows=1).launch()
    cp.cuda.runtime.deviceSynchronize()
    want = f32_to_raw(fp8.dequantize_wire_rows(rows, hidden), dtype).view(np.uint16)
    got, got_shared = staging.get(), shared_staging.get()
    np.testing.assert_array_equal(got[:10], want[:10])
    np.testing.assert_array_equal(got_shared[:4], want[10:14])
    assert (got[10:] == 0x7FFF).all() and (got_shared[4:] == 0x7FFF).all()
    assert not got[3, :wire.FP8_GROUP].any()  # the zero group


@pytest.mark.parametrize("receiver_fp8", [True, False])
def test_stage_rejects_the_other_row_format(request, receiver_fp8):
    """The stage of an FP8 connector (is_fp8=1) rejects a payload dispatch and a payload
    connector's an FP8 one (wire.dispatch_rows_fault): REJECTED at header word HDR_FLAGS, no
    seq reserved, nothing staged."""
    rng = node_rng(request)
    layout = small_layout(expert_per_rank=EPR, hidden_size=128,
                          dispatch_dtype="fp8_e4m3" if receiver_fp8 else "payload")
    st = Stage(rng, layout=layout)
    header = wire.dispatch_header(seq=5, src_rank=0, layer_idx=1, stage_idx=0, num_tokens=12, shared_tokens=3,
                                  top_k=4, expert_counts=(2, 2, 2, 2), fp8=not receiver_fp8)
    words = wire.encode_header(header, EPR)
    st.arrive(0, words)
    seqs_before, replay = st.reply_seqs.get(), int(st.replay_counter.get()[0])
    st.launch().launch()
    cp.cuda.runtime.deviceSynchronize()
    rec = st.record(replay)
    assert rec[ffn_graph.REC_STATUS] == ffn_graph.GS_REJECTED and rec[ffn_graph.REC_DETAIL] == wire.HDR_FLAGS
    assert st.state.get()[ffn_graph.STATE_ACTIVE] == 0 and rec[ffn_graph.REC_SEQ] == 0
    np.testing.assert_array_equal(st.reply_seqs.get(), seqs_before)
    assert not st.routed_offs.get().any()


@pytest.mark.parametrize("tokens", [(1, 5, 16, 40, 3)])
def test_graph_server_identity_over_fp8_dispatch_rows(tokens):
    """GraphFFNServer(identity=True) on an FP8 dispatch connector: the graph's gather decodes
    the rows and the reply answers with them, so every output is the combine of the decoded
    rows (within bf16 rounding of the reference from wire.fp8's round trip) and within
    DeepEP's calc_diff budget of the unquantized output; a 40-token layer (past the buckets)
    is decoded by the eager fallback on its own stream."""
    from afd_cupy.config import ModelConfig
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_identity_rank

    model = ModelConfig(hidden_size=256, num_experts=8, top_k=2, moe_intermediate_size=64,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64, num_layers=4)
    attn, ffn = launch(run_graph_identity_rank, 2, args=(model, "pair", tokens, False, "fp8_e4m3", (4, 16)),
                       timeout_s=240)
    assert ffn["error"] is None and ffn["served"] == len(tokens) and ffn["eager"] >= 1
    for err in attn["errors"]:
        assert err["num_nan"] == 0 and err["rel_err_quantized"] < 4e-3, err
        assert 1e-2 < err["rel_err"] < 0.05 and err["calc_diff"] < 7e-4, err


@pytest.mark.parametrize("expert_gemm,fp8_experts", [("grouped_mm", False), ("stream", True)])
def test_graph_server_with_experts_over_fp8_dispatch_rows(expert_gemm, fp8_experts):
    """GraphFFNServer with real experts on an FP8 dispatch connector (bf16 experts through
    torch._grouped_mm; FP8 experts through the streamed kernels: FP8 end to end), layers of 4,
    16, 40 (eager) and 1 tokens: every output within the documented FP8 budget of the fp64
    reference (docs/design/fp8.md: 0.06 for the dispatch, 0.1 with FP8 weights too)."""
    from afd_cupy.config import ConnectorConfig, ModelConfig
    from afd_cupy.moe import stream_gemm
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.graph_ffn import run_graph_rank
    from afd_cupy.testing.scenario import Scenario

    if expert_gemm == "stream" and stream_gemm.unavailable_reason("cuda") is not None:
        pytest.skip(stream_gemm.unavailable_reason("cuda"))
    if expert_gemm == "grouped_mm" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the graph FFN's GEMM mode needs torch._grouped_mm on SM90/SM100")
    tokens = (4, 16, 40, 1, 16)
    model = ModelConfig(hidden_size=256, num_experts=8, top_k=2, moe_intermediate_size=192,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64,
                        num_layers=len(tokens), routed_scaling_factor=2.5)
    scenario = Scenario(model, 1, 1, backend="cuda", tokens=(tokens,),
                        connector=ConnectorConfig(dispatch_dtype="fp8_e4m3"))
    attn, ffn = launch(run_graph_rank, 2, args=(scenario, (4, 16), expert_gemm, fp8_experts), timeout_s=240)
    assert ffn["served"] == len(tokens) and ffn["eager"] >= 1
    bound = 0.1 if fp8_experts else 0.06
    assert len(attn["errors"]) == len(tokens)
    for err in attn["errors"]:
        assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= bound, err
