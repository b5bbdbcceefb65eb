"""The lockstep schedule of ``FFNWorker`` (the synchronous baseline of the async connector).

- In-process: the merge of several work items into one expert-grouped batch and the split of
  the outputs back, against per-item computation, on random counts (zeros included); the
  buffering logic against a scripted connector.
- Real processes (host backend, like test_e2e): 2A1F and 2A2F with one replica sleeping
  between layers. Results equal the reference MoE; the FFN serves layer L only as one batch
  holding every replica's layer L, so the fast replica is held back (and is not under async).
"""
import time

import numpy as np
import pytest
import torch

from afd_cupy import moe, wire
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.errors import ConfigError
from afd_cupy.ffn.worker import (FFNWorker, attention_connector_kwargs, merge_items, merge_order,
                                 split_outputs)
from afd_cupy.moe import carveout
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.testing.reference import (identity_experts, make_expert_weights, make_shared_weights,
                                        reference_moe)
from afd_cupy.testing.scenario import layer_weights, tolerance

from helpers.fakes import FAKE_HIDDEN, FakeCarveout, scripted_connector, work_item

# --------------------------------------------------------------------------- in-process helpers

def _random_counts(rng, num_items, num_experts):
    counts = rng.integers(0, 6, size=(num_items, num_experts))
    counts[rng.random(counts.shape) < 0.3] = 0  # plenty of empty groups
    if num_items > 1:
        counts[rng.integers(num_items)] = 0  # and one item with no routed rows at all
    return counts


# --------------------------------------------------------------------------- merge / split

def test_merge_order_small_case():
    # item 0: e0 rows [0,1], e1 row [2]; item 1: e0 row [3], e1 rows [4,5]
    order = merge_order(np.array([[2, 1], [1, 2]]))
    assert order.tolist() == [0, 1, 3, 2, 4, 5]
    assert merge_order(np.zeros((3, 4), np.int64)).tolist() == []


@pytest.mark.parametrize("seed", range(6))
def test_merge_groups_by_expert_and_split_restores_wire_order(seed):
    rng = np.random.default_rng(seed)
    num_items, num_experts = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    counts = _random_counts(rng, num_items, num_experts)
    items = [work_item(i, counts[i], int(rng.integers(0, 4)), seed=seed) for i in range(num_items)]
    batch = merge_items(items)
    assert batch.group_counts_host == counts.sum(axis=0).tolist()
    start = 0  # expert-major: for each expert, item 0's group, then item 1's, ...
    for expert in range(num_experts):
        for i, item in enumerate(items):
            first = int(counts[i, :expert].sum())
            rows = item.routed_x[first:first + counts[i, expert]]
            torch.testing.assert_close(batch.routed_x[start:start + len(rows)], rows, rtol=0, atol=0)
            start += len(rows)
    assert start == batch.routed_x.shape[0]
    for item, (routed, shared) in zip(items, split_outputs(batch, batch.routed_x, batch.shared_x)):
        torch.testing.assert_close(routed, item.routed_x, rtol=0, atol=0)
        if item.shared_x is None:
            assert shared is None
        else:
            torch.testing.assert_close(shared, item.shared_x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1.0), (torch.bfloat16, 2.5), (torch.float16, 4.0)])
@pytest.mark.parametrize("seed", range(4))
def test_merged_batch_equals_per_item_compute(seed, dtype, scale):
    rng = np.random.default_rng(100 + seed)
    num_items, num_experts = int(rng.integers(2, 5)), 4
    experts = make_expert_weights(num_experts, FAKE_HIDDEN, 16, dtype=dtype, device="cpu", seed=seed)
    shared = make_shared_weights(2, FAKE_HIDDEN, 16, dtype=dtype, device="cpu", seed=seed + 1)
    counts = _random_counts(rng, num_items, num_experts)
    items = [work_item(i, counts[i], int(rng.integers(0, 4)), dtype=dtype, seed=seed) for i in range(num_items)]
    worker = FFNWorker(scripted_connector(num_items, routed_scaling_factor=scale, dtype=dtype), experts,
                       shared, schedule="lockstep")
    merged = worker._merged_outputs(items)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for item, (routed, shared_out) in zip(items, merged):
        want_routed, want_shared = worker._moe_outputs(item)
        assert routed.shape == (item.routed_tokens, FAKE_HIDDEN) and routed.dtype == dtype
        torch.testing.assert_close(routed.float(), want_routed.float(), rtol=tol, atol=tol)
        if want_shared is None:
            assert shared_out is None
        else:
            torch.testing.assert_close(shared_out.float(), want_shared.float(), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- buffering logic

def test_lockstep_buffers_until_every_rank_sent_the_layer():
    items = [work_item(0, [1, 0], 1, layer_idx=0), work_item(0, [0, 2], 0, layer_idx=1, stage_idx=1),
             work_item(1, [2, 1], 1, layer_idx=1, stage_idx=1), work_item(1, [0, 0], 0, layer_idx=0),
             work_item(2, [1, 1], 0, layer_idx=1, stage_idx=1), work_item(2, [0, 1], 1, layer_idx=0)]
    conn = scripted_connector(num_attn=3, num_layers=4, items=items)
    batches = []
    worker = FFNWorker(conn, expert_fn=identity_experts, schedule="lockstep")
    worker.serve_batch = lambda batch: batches.append([(i.src_rank, i.layer_idx) for i in batch])
    worker.step(timeout_ms=0)
    assert batches == [[(0, 1), (1, 1), (2, 1)], [(0, 0), (1, 0), (2, 0)]]
    assert worker.num_waiting == 0


def test_lockstep_answers_every_item_of_a_batch_and_async_is_unchanged():
    items = [work_item(1, [1, 2], 1), work_item(0, [0, 0], 2)]
    conn = scripted_connector(num_attn=2, items=items + ["shutdown"])
    assert FFNWorker(conn, expert_fn=identity_experts, schedule="lockstep").run() == 2
    assert [item.src_rank for item, _, _ in conn.sent] == [0, 1]  # by rank, after both arrived
    conn = scripted_connector(num_attn=2, items=items + ["shutdown"])
    assert FFNWorker(conn, expert_fn=identity_experts).run() == 2
    assert [item.src_rank for item, _, _ in conn.sent] == [1, 0]  # as they arrived


def test_shutdown_with_held_items_warns(caplog):
    conn = scripted_connector(num_attn=2, items=[work_item(0, [1, 1], 0, layer_idx=3), "shutdown"])
    worker = FFNWorker(conn, expert_fn=identity_experts, schedule="lockstep")
    with caplog.at_level("WARNING", logger="afd_cupy"):
        assert worker.run() == 0
    assert "never served" in caplog.text and "layer 3" in caplog.text


def test_bad_schedule_is_rejected():
    with pytest.raises(ValueError, match="schedule must be one of"):
        FFNWorker(scripted_connector(), expert_fn=identity_experts, schedule="sync")
    assert attention_connector_kwargs("async") == {}
    assert attention_connector_kwargs("lockstep") == {"always_send": True}


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_gemm_sm_carveout_wraps_every_expert_call_and_nothing_else(monkeypatch, schedule):
    """gemm_sm_carveout=n: each expert call (per item, or the merged lockstep batch) runs with
    torch's carve-out set to n, the replies and the receives without it; 0 never calls torch."""
    fake = FakeCarveout().install(monkeypatch)
    experts = make_expert_weights(2, FAKE_HIDDEN, 16, dtype=torch.float32, device="cpu", seed=0)
    shared = make_shared_weights(2, FAKE_HIDDEN, 16, dtype=torch.float32, device="cpu", seed=1)
    items = [work_item(0, [1, 2], 1, layer_idx=0), work_item(1, [2, 0], 2, layer_idx=0), work_item(1, [0, 1], 0, layer_idx=1),
             work_item(0, [1, 1], 0, layer_idx=1)]
    conn = scripted_connector(num_attn=2, items=items + ["shutdown"], experts_per_rank=2)
    conn.device = torch.device("cpu")
    seen = {"compute": [], "reply": []}
    send = conn.send_ffn_work_item_output
    conn.send_ffn_work_item_output = lambda *args: (seen["reply"].append(fake.value), send(*args))
    worker = FFNWorker(conn, experts, shared, schedule=schedule, gemm_sm_carveout=3)
    compute = worker._merged_outputs
    worker._merged_outputs = lambda batch: (seen["compute"].append(fake.value), compute(batch))[1]
    if schedule == "async":
        moe_outputs = worker.expert_fn
        worker.expert_fn = lambda item: (seen["compute"].append(fake.value), moe_outputs(item))[1]
    assert worker.run() == 4 and len(conn.sent) == 4
    assert seen["compute"] == [3] * (4 if schedule == "async" else 2) and seen["reply"] == [None] * 4
    assert fake.value is None and fake.calls == [3, None] * len(seen["compute"])
    # the same items without a carve-out: the same outputs, and torch is never asked
    plain_conn = scripted_connector(num_attn=2, items=items + ["shutdown"], experts_per_rank=2)
    fake.calls.clear()
    assert FFNWorker(plain_conn, experts, shared, schedule=schedule).run() == 4
    assert fake.calls == [] and fake.reads == len(seen["compute"])  # one read per scope, above
    for (item, routed, shared_out), (_, want_routed, want_shared) in zip(conn.sent, plain_conn.sent):
        assert torch.equal(routed, want_routed)
        assert (shared_out is None) == (want_shared is None)
        assert shared_out is None or torch.equal(shared_out, want_shared)


def test_gemm_sm_carveout_is_validated_at_construction(monkeypatch):
    FakeCarveout().install(monkeypatch)
    conn = scripted_connector()  # no device attribute: "auto" (the default) is 0, a value > 0 is kept
    assert FFNWorker(conn, expert_fn=identity_experts).gemm_sm_carveout == 0
    assert FFNWorker(conn, expert_fn=identity_experts, gemm_sm_carveout=3).gemm_sm_carveout == 3
    conn.device = torch.device("cpu")  # the host backend: "auto" is 0
    assert FFNWorker(conn, expert_fn=identity_experts, gemm_sm_carveout="auto").gemm_sm_carveout == 0
    conn.device = torch.device("cuda", 0)
    monkeypatch.setattr(carveout, "_sm_count", lambda device: 132)
    assert FFNWorker(conn, expert_fn=identity_experts).gemm_sm_carveout == moe.AUTO_GEMM_SM_CARVEOUT == 2
    assert FFNWorker(conn, expert_fn=identity_experts, gemm_sm_carveout=131).gemm_sm_carveout == 131
    for value, match in ((132, r"FFNWorker.gemm_sm_carveout=132 must be < the SM count of cuda:0 \(132\)"),
                         (-2, r"FFNWorker.gemm_sm_carveout must be >= 0, got -2"),
                         (2.0, r"FFNWorker.gemm_sm_carveout must be an int >= 0 .*got float 2.0"),
                         ("2", r"FFNWorker.gemm_sm_carveout must be 'auto' or an int >= 0 .*got '2'"),
                         (False, r"must be an int >= 0 .*got bool False")):
        with pytest.raises(ConfigError, match=match):
            FFNWorker(conn, expert_fn=identity_experts, gemm_sm_carveout=value)
    monkeypatch.delattr(torch._C, "_get_sm_carveout_experimental")
    with pytest.raises(ConfigError, match="FFNWorker.gemm_sm_carveout=1 needs torch._C"):
        FFNWorker(conn, expert_fn=identity_experts, gemm_sm_carveout=1)
    assert FFNWorker(conn, expert_fn=identity_experts).gemm_sm_carveout == 0  # "auto": no binding, 0


# --------------------------------------------------------------------------- real processes

MODEL = ModelConfig(hidden_size=64, num_experts=8, top_k=2, moe_intermediate_size=32,
                    num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=48,
                    routed_scaling_factor=2.5, num_layers=4)
SLEEP_S = 0.3
SEED = 3


class _RecordingWorker(FFNWorker):
    """Notes every served batch: (layer, stage, source ranks, monotonic time)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = []

    def serve_batch(self, items):
        self.history.append((items[0].layer_idx, items[0].stage_idx,
                             [item.src_rank for item in items], time.monotonic()))
        super().serve_batch(items)

    def serve(self, item):
        self.history.append((item.layer_idx, item.stage_idx, [item.src_rank], time.monotonic()))
        super().serve(item)


def _rank(ctx, num_attn, num_ffn, schedule, tokens, wire_mode):
    topo = Topology(num_attn, num_ffn, MODEL.num_experts)
    role, role_rank = topo.role_of(ctx.rank)
    extra = attention_connector_kwargs(schedule) if role is Role.ATTENTION else {}
    conn = AFDConnector(MODEL, TopologyConfig(num_attn, num_ffn), ConnectorConfig(wire_mode=wire_mode),
                        role=role, role_rank=role_rank,
                        store=ctx.store(), job_id=ctx.job_id, backend="host", peer_timeout_s=30.0,
                        **extra)
    try:
        if role is Role.FFN:
            return _ffn_rank(conn, role_rank, schedule)
        return _attention_rank(conn, role_rank, tokens[role_rank])
    finally:
        conn.close()


def _ffn_rank(conn, ffn_rank, schedule):
    routed, shared = [], []
    for layer in range(MODEL.num_layers):
        global_routed, layer_shared = layer_weights(MODEL, layer, SEED, "cpu")
        routed.append(moe.local_experts(global_routed, ffn_rank, conn.topology.expert_per_rank))
        shared.append(layer_shared)
    worker = _RecordingWorker(conn, routed, shared, schedule=schedule)
    worker.run()
    return {"role": "ffn", "history": worker.history, "served": worker.num_served}


def _attention_rank(conn, attn_rank, tokens):
    gen = torch.Generator().manual_seed(SEED * 7919 + attn_rank)
    sent, outputs, layer_done = [], [], []
    for layer, num_tokens in enumerate(tokens):
        hidden = torch.randn(num_tokens, MODEL.hidden_size, generator=gen).to(torch.bfloat16)
        weights, ids = conn.select_experts(torch.randn(num_tokens, MODEL.num_experts, generator=gen))
        outputs.append(conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, layer)))
        layer_done.append(time.monotonic())
        sent.append((hidden, ids, weights))
        if attn_rank == 0 and layer + 1 < len(tokens):
            time.sleep(SLEEP_S)  # the slow replica
    conn.announce_shutdown()
    errors = []  # checked after the timed loop: the fp64 reference is slow
    for layer, ((hidden, ids, weights), out) in enumerate(zip(sent, outputs)):
        routed, shared = layer_weights(MODEL, layer, SEED, "cpu")
        ref = reference_moe(hidden, ids, weights, routed, shared, MODEL.routed_scaling_factor)
        rel = float((out.float() - ref).norm()) / (float(ref.norm()) or 1.0)
        errors.append(rel if not torch.isnan(out).any() else float("inf"))
    # from the end of layer 0 (which includes warm-up) to the end of the last layer
    return {"role": "attention", "rank": attn_rank, "errors": errors,
            "elapsed": layer_done[-1] - layer_done[0]}


def _launch(num_attn, num_ffn, schedule, tokens, wire_mode="pair"):
    results = launch(_rank, num_attn + num_ffn, args=(num_attn, num_ffn, schedule, tokens, wire_mode),
                     timeout_s=120)
    attn, ffn = results[:num_attn], results[num_attn:]
    for report in attn:
        assert max(report["errors"]) <= tolerance(MODEL.dtype), report
    return attn, ffn


def _check_lockstep_history(history, num_attn, num_layers):
    """Batches in layer order, each with every replica: layer L+1 of nobody before all L."""
    assert [layer for layer, *_ in history] == list(range(num_layers)), history
    for layer, stage, sources, _ in history:
        assert sources == list(range(num_attn)), (layer, sources)


def test_lockstep_2a1f_holds_back_the_fast_replica():
    attn, (ffn,) = _launch(2, 1, "lockstep", ((20, 7, 33, 16), (11, 24, 5, 30)))
    _check_lockstep_history(ffn["history"], 2, MODEL.num_layers)
    assert ffn["served"] == 2 * MODEL.num_layers
    slow_sleeps = SLEEP_S * (MODEL.num_layers - 1)
    assert attn[1]["elapsed"] >= 0.9 * slow_sleeps, attn  # waited for the sleeper every layer


def test_async_2a1f_lets_the_fast_replica_run_ahead():
    attn, (ffn,) = _launch(2, 1, "async", ((20, 7, 33, 16), (11, 24, 5, 30)))
    assert all(len(sources) == 1 for *_, sources, _ in ffn["history"])
    assert attn[1]["elapsed"] < 0.5 * SLEEP_S * (MODEL.num_layers - 1), attn


@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
def test_lockstep_2a2f_with_empty_and_one_token_layers(wire_mode):
    # replica 0 sends nothing at layer 1 and one token at layer 3 (so one FFN rank gets no
    # rows from it): always_send keeps every FFN rank's batch complete. In dedup mode the
    # merged batch runs on the expanded staging of every item.
    attn, ffn = _launch(2, 2, "lockstep", ((20, 0, 33, 1), (11, 24, 1, 30)), wire_mode)
    for report in ffn:
        _check_lockstep_history(report["history"], 2, MODEL.num_layers)
    assert attn[1]["elapsed"] >= 0.9 * SLEEP_S * (MODEL.num_layers - 1), attn


def test_worker_weights_must_match_the_model_config():
    experts = make_expert_weights(4, FAKE_HIDDEN, 16, dtype=torch.float32, device="cpu", seed=0)
    shared = make_shared_weights(2, FAKE_HIDDEN, 16, dtype=torch.float32, device="cpu", seed=1)
    with pytest.raises(ConfigError, match=r"routed experts are \(num_experts, hidden, intermediate, dtype\) "
                                          r"= \(4, 32, 16, torch.float32\), the ModelConfig says \(4, 32, 24"):
        FFNWorker(scripted_connector(intermediate=24), experts, shared)
    with pytest.raises(ConfigError, match="shared expert weights missing but ModelConfig.num_shared_experts=2"):
        FFNWorker(scripted_connector(), experts, None)
    with pytest.raises(ConfigError, match="weights for 3 routed / 2 shared layers"):
        FFNWorker(scripted_connector(num_layers=2), [experts] * 3, shared)
