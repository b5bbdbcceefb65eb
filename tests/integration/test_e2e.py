"""End-to-end AFD MoE runs through the real connector, in real processes, against a
single-process fp64 per-token MoE reference. Host backend in CI, in both wire modes; the same
cases with the ``cuda`` marker on a GPU (several processes on one GPU; device polling needs
CUDA MPS), in both wire modes over the direct and the put transport, and mixed jobs."""
import dataclasses

import pytest

from afd_cupy import moe
from afd_cupy.config import ConnectorConfig, ModelConfig
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Role
from afd_cupy.testing.reference import identity_experts
from afd_cupy.testing.scenario import Scenario, run_rank, tolerance

from helpers.backends import BACKENDS, PATHS
from helpers.programs import FAULT_MODEL, POLL_MODE, connect, seeded_inputs

CUDA_TRANSPORTS = [pytest.param("cuda", id="direct"), pytest.param("cuda-put", id="put")]


def _model(**overrides):
    base = dict(hidden_size=64, num_experts=8, top_k=2, moe_intermediate_size=32,
                num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=96, num_layers=2)
    base.update(overrides)
    return ModelConfig(**base)


def _run(scenario: Scenario, timeout_s=180):
    results = launch(run_rank, scenario.world_size, args=(scenario,), timeout_s=timeout_s)
    attn = [r for r in results if r["role"] == "attention"]
    ffn = [r for r in results if r["role"] == "ffn"]
    tol = tolerance(scenario.model.dtype)
    for report in attn:
        assert len(report["errors"]) == scenario.num_checks
        for err in report["errors"]:
            assert err["shape_ok"] and err["num_nan"] == 0, err
            assert err["rel_err"] <= tol, (report["rank"], err)
    return attn, ffn


def _scenario(backend, model, num_attn, num_ffn, wire_mode="pair", **kw):
    backend, _, transport = backend.partition("-")  # "cuda-put": the put transport
    mixed = transport == "mixed"  # "cuda-mixed": auto, some pairs forced to puts
    connector = dataclasses.replace(kw.pop("connector", ConnectorConfig()), wire_mode=wire_mode,
                                    transport="auto" if mixed else transport or "direct")
    return Scenario(model, num_attn, num_ffn, backend=backend, poll_mode=POLL_MODE,
                    connector=connector, mixed_transport=mixed, **kw)


@pytest.mark.parametrize("backend,wire_mode", PATHS)
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2), (2, 1), (1, 2), (3, 2)])
def test_topologies_match_reference(backend, wire_mode, num_attn, num_ffn):
    attn, ffn = _run(_scenario(backend, _model(), num_attn, num_ffn, wire_mode, num_tokens=40))
    served = sum(r["served"] for r in ffn)
    assert served == num_attn * 2 * num_ffn  # 40 tokens reach every rank each layer


@pytest.mark.parametrize("backend", BACKENDS)  # dedup: padded tails in test_dedup's plans
def test_experts_not_divisible_by_ffn_ranks_no_shared(backend):
    model = _model(num_experts=10, top_k=3, num_shared_experts=0)
    _run(_scenario(backend, model, 2, 3, num_tokens=33))


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_zero_one_and_many_tokens(backend, wire_mode):
    # 512 tokens = token_cap: a full dedup slot (one row per token on a rank)
    model = _model(num_layers=3, max_num_batched_tokens=512)
    tokens = ((0, 1, 512), (1, 0, 300))
    attn, ffn = _run(_scenario(backend, model, 2, 2, wire_mode, tokens=tokens))
    layers_served = {(src, layer) for r in ffn for (src, layer, *_rest) in r["history"]}
    assert (0, 0) not in layers_served and (1, 1) not in layers_served  # empty: never sent


@pytest.mark.parametrize("backend", BACKENDS)  # the schedule does not depend on the wire mode
def test_replicas_at_different_layers_served_out_of_order(backend):
    model = _model(num_layers=4)
    attn, ffn = _run(_scenario(backend, model, 2, 1, num_tokens=24, sleep_s=(0.4, 0.0)))
    history = [(src, layer) for src, layer, *_ in ffn[0]["history"]]
    fast_done = history.index((1, 3))
    slow_layers_before = [layer for src, layer in history[:fast_done] if src == 0]
    assert max(slow_layers_before, default=-1) < 3  # the fast replica finished first
    assert len(history) == 8


@pytest.mark.parametrize("backend,wire_mode", PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtypes_with_routed_scaling(backend, wire_mode, dtype):
    model = _model(dtype=dtype, routed_scaling_factor=2.5, num_shared_experts=2)
    _run(_scenario(backend, model, 2, 2, wire_mode, num_tokens=31))


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_rank_with_zero_routed_rows_fp16(backend, wire_mode):
    # every token prefers FFN rank 0's experts: in pair mode rank 1 gets shared rows only (the
    # fp16 rule on a reply without routed rows); in dedup mode the shared experts run where the
    # tokens go, so rank 1 gets nothing at all
    model = _model(dtype="float16", routed_scaling_factor=4.0, top_k=2)
    attn, ffn = _run(_scenario(backend, model, 1, 2, wire_mode, num_tokens=12, favor_ffn_rank=0))
    rank0, rank1 = sorted(ffn, key=lambda r: r["rank"])
    if wire_mode == "pair":
        assert rank1["history"] and all(routed == 0 and shared > 0 for _, _, routed, shared in rank1["history"])
    else:
        assert rank1["history"] == [] and all(shared == 12 for *_, shared in rank0["history"])


def _stage_rings_program(ctx, backend, wire_mode):
    """2A2F with two micro-batch stages (ring depth 2: stage s owns ring s): every layer sends
    both stages before receiving either (odd layers stage 1 first), each with its own seeded
    rows, and checks both outputs (identity experts: hidden * (sum w + 1)). Reports the (stage,
    ring) of every handle sent and of every item the FFN served."""
    cfg = ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches=2, wire_mode=wire_mode)
    conn, role, role_rank = connect(ctx, backend, 2, 2, connector=cfg, timeout_s=30.0)
    try:
        if role is Role.FFN:
            seen = []

            def record(item):
                seen.append((item.stage_idx, item.arrival.ring))
                return identity_experts(item)

            return {"served": FFNWorker(conn, expert_fn=record).run(), "seen": seen}
        sent, errors = [], []
        for layer in range(FAULT_MODEL.num_layers):
            inputs = [seeded_inputs(conn, 5 + 3 * stage, seed=100 * role_rank + 10 * layer + stage)
                      for stage in (0, 1)]
            order = (1, 0) if layer % 2 else (0, 1)  # a ring pool shared by the stages fails too
            handles = {stage: conn.send_attn_output(*inputs[stage], layer, stage) for stage in order}
            sent += [(handles[stage].stage_idx, handles[stage].ring) for stage in order]
            for stage in order:
                (hidden, _, weights), handle = inputs[stage], handles[stage]
                out = conn.recv_ffn_output(handle)
                expect = hidden.float() * (weights.float().sum(dim=1, keepdim=True) + 1.0)
                errors.append(float((out.float() - expect).abs().max()))
        conn.announce_shutdown()
        return {"sent": sent, "errors": errors}
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_micro_batch_stages_use_their_own_rings(backend, wire_mode):
    # both stages of a layer in flight at once: a shared ring would refuse the second send
    # (RingExhaustedError) or overwrite the first stage's message (wrong outputs)
    *attn, ffn0, ffn1 = launch(_stage_rings_program, 4, args=(backend, wire_mode), timeout_s=300)
    want = [(0, 0), (1, 1), (1, 1), (0, 0)] * (FAULT_MODEL.num_layers // 2)  # (stage, ring) sent
    for report in attn:
        assert report["sent"] == want, report["sent"]
        assert max(report["errors"]) < 0.1, report["errors"]
    seen = ffn0["seen"] + ffn1["seen"]
    assert set(seen) == {(0, 0), (1, 1)}, seen  # each stage's messages arrived on its own ring
    assert 2 * [stage for stage, _ in seen].count(1) == len(seen), seen


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_lockstep_schedule_with_uneven_replicas(backend, wire_mode):
    # the lockstep FFN schedule (every replica's layer merged into one batch) with a slow
    # replica, a 0-token and a 1-token layer; always_send keeps every FFN rank's batch complete
    model = _model(num_layers=4)
    tokens = ((20, 0, 33, 1), (11, 24, 1, 30))
    attn, ffn = _run(_scenario(backend, model, 2, 2, wire_mode, tokens=tokens, sleep_s=(0.05, 0.0),
                               schedule="lockstep", always_send=True))
    for report in ffn:  # one merged batch per layer, in layer order
        assert [layer for _, layer, *_ in report["history"]] == sorted(
            layer for _, layer, *_ in report["history"])


@pytest.mark.parametrize("backend", BACKENDS)  # dedup: test_lockstep's 2A2F with empty layers
def test_always_send_reaches_every_rank(backend):
    # 1 token, top-1: without always_send only one FFN rank would get a message per layer
    model = _model(top_k=1, num_shared_experts=0)
    attn, ffn = _run(_scenario(backend, model, 1, 2, num_tokens=1, always_send=True))
    assert [r["served"] for r in ffn] == [2, 2]
    assert sum(routed for r in ffn for _, _, routed, _ in r["history"]) == 2


@pytest.mark.cuda
@pytest.mark.parametrize("backend,wire_mode", [  # put: are NVSHMEM's on-stream puts capturable?
    pytest.param("cuda", "pair", id="direct"), pytest.param("cuda-put", "pair", id="put"),
    pytest.param("cuda", "dedup", id="dedup"), pytest.param("cuda-put", "dedup", id="put-dedup")])
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2)])
def test_attention_layers_replayed_from_cuda_graphs(backend, wire_mode, num_attn, num_ffn):
    # each layer's send + recv captured once, replayed 3 times with fresh inputs and NaN outputs
    replays, model = 3, _model(num_layers=3)
    attn, ffn = _run(_scenario(backend, model, num_attn, num_ffn, wire_mode, num_tokens=40,
                               graph_replays=replays))
    # every replay really sent: 40 tokens reach every FFN rank at every layer (no stale outputs)
    assert sum(r["served"] for r in ffn) == num_attn * model.num_layers * replays * num_ffn
    assert {layer for r in ffn for _, layer, *_ in r["history"]} == set(range(model.num_layers))


@pytest.mark.cuda
@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
@pytest.mark.parametrize("num_attn,num_ffn", [(2, 2), (1, 2), (2, 1), (3, 2)])
def test_mixed_job_direct_and_put_peers(wire_mode, num_attn, num_ffn):
    # transport="auto" where some peers need puts (docs/design/put-transport.md): every rank with two or more
    # peers has both kinds; the scatter, the reply and the shutdown choose per peer
    model = _model(num_layers=3)
    tokens = tuple((0, 17, 40) if a == 0 else (40, 1, 23) for a in range(num_attn))  # empty layer too
    attn, ffn = _run(_scenario("cuda-mixed", model, num_attn, num_ffn, wire_mode, tokens=tokens))
    assert len(attn) == num_attn and len(ffn) == num_ffn


@pytest.mark.cuda
def test_mixed_job_with_graph_capture_and_always_send():
    model = _model(num_layers=3)
    _run(_scenario("cuda-mixed", model, 2, 2, "dedup", num_tokens=24, graph_replays=2,
                   always_send=True))


def _num_gpus():
    import torch
    return torch.cuda.device_count()


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
@pytest.mark.parametrize("backend", CUDA_TRANSPORTS)
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2)])
def test_one_process_per_gpu_over_nvlink(backend, num_attn, num_ffn, wire_mode):
    world = num_attn + num_ffn
    if _num_gpus() < world:
        pytest.skip(f"{num_attn}A{num_ffn}F needs {world} GPUs, {_num_gpus()} visible")
    attn, ffn = _run(_scenario(backend, _model(num_layers=3), num_attn, num_ffn, wire_mode, num_tokens=64))
    assert sorted(r["device_id"] for r in attn + ffn) == list(range(world))  # peers across GPUs


@pytest.mark.parametrize("backend,wire_mode,schedule", [
    pytest.param("host", "pair", "async", id="host"), pytest.param("host", "dedup", "async", id="host-dedup"),
    pytest.param("host", "pair", "lockstep", id="host-lockstep"),
    pytest.param("cuda", "pair", "async", id="cuda", marks=pytest.mark.cuda),
    pytest.param("cuda", "dedup", "async", id="cuda-dedup", marks=pytest.mark.cuda)])
def test_ffn_overlap_gives_the_default_outputs(backend, wire_mode, schedule):
    # FFNWorker(overlap=True): replies on a reply thread (host) / stream (cuda) while the next
    # item is received and computed; replicas at different layers so items interleave
    model = _model(num_layers=4)
    runs = []
    for overlap in (False, True):
        scenario = _scenario(backend, model, 2, 2, wire_mode, num_tokens=24, sleep_s=(0.05, 0.0),
                             schedule=schedule, ffn_overlap=overlap)
        attn, ffn = _run(scenario)
        assert sum(r["served"] for r in ffn) == 2 * model.num_layers * 2
        runs.append({r["rank"]: [(e["layer"], e["rel_err"]) for e in r["errors"]] for r in attn})
    assert runs[1] == runs[0]  # the same outputs, bit for bit (same inputs, same compute)


@pytest.mark.parametrize("backend", [pytest.param("host", id="host"),
                                     pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
def test_gemm_sm_carveout_gives_the_default_outputs(backend):
    # FFNWorker(gemm_sm_carveout="auto"), the default: on cuda every expert call runs with
    # torch's carve-out at moe.AUTO_GEMM_SM_CARVEOUT (the FFN reports what its expert calls
    # saw), on the host backend at nothing; the outputs equal those of 0 bit for bit.
    # No shared experts: the routed grouped GEMM's persistent kernel computes each tile the
    # same way whatever its grid; cuBLAS (the shared MLP) may choose another algorithm for a
    # smaller SM target (held to the bf16 tolerance in test_moe.py). Host: CPU GEMMs ignore it.
    # Intermediate 1408 (V2-Lite's): the gate/up GEMM has more tiles than an H200 has SMs, so
    # its grid really shrinks (test_moe.py checks a grid of half the SMs on its own).
    model = _model(num_layers=3, num_shared_experts=0, hidden_size=256, moe_intermediate_size=1408)
    runs = []
    auto = moe.AUTO_GEMM_SM_CARVEOUT if backend == "cuda" else 0
    assert auto > 0 or backend == "host"
    for carveout in (0, "auto"):
        attn, ffn = _run(_scenario(backend, model, 1, 1, num_tokens=96, gemm_sm_carveout=carveout))
        assert ffn[0]["served"] == model.num_layers
        assert ffn[0]["gemm_sm_carveout"] == (auto if carveout == "auto" else 0)
        assert ffn[0]["carveouts"] == ([auto] if carveout == "auto" and auto else [None])
        runs.append([(e["layer"], e["rel_err"]) for e in attn[0]["errors"]])
    assert runs[1] == runs[0]


@pytest.mark.parametrize("backend,graph_replays", [
    pytest.param("host", 0, id="host"), pytest.param("cuda", 0, id="cuda", marks=pytest.mark.cuda),
    pytest.param("cuda", 3, id="cuda-graphs", marks=pytest.mark.cuda)])
def test_two_stages_in_flight_on_two_streams(backend, graph_replays):
    # both halves of a layer in flight at once (stage 0, stage 1; cuda: stage 1 on a second
    # stream, events only, blocking=False receives), optionally captured in one graph per layer
    cfg = ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches=2)
    model = _model(num_layers=3)
    attn, ffn = _run(_scenario(backend, model, 2, 2, num_tokens=40, connector=cfg, stage_streams=True,
                               graph_replays=graph_replays))
    stages = {stage for r in ffn for stage in r["stages"]}
    assert stages == {0, 1}
