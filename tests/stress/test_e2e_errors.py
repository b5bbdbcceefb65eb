"""Failure paths end to end: capacity overflow, peer timeout, shutdown from either side,
cleanup. Each test runs small programs in real processes (bad input: test_faults.py)."""
import os
import re

import pytest
import torch

from afd_cupy.config import ConnectorConfig, ModelConfig
from afd_cupy.errors import CapacityError, ConnectorShutdown, InvalidRoutingError, PeerTimeoutError
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.heap.host import segment_path
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Role
from afd_cupy.testing.reference import identity_experts

from helpers.backends import PATHS
from helpers.programs import connect

MODEL = ModelConfig(hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16,
                    num_shared_experts=0, dtype="bfloat16", max_num_batched_tokens=16, num_layers=8)


def _connect(ctx, backend, num_attn, num_ffn, connector=None, timeout_s=30.0):
    """This file's model (no shared expert), a 30 s peer timeout by default, the default start-up
    bound."""
    return connect(ctx, backend, num_attn, num_ffn, model=MODEL, timeout_s=timeout_s,
                   connector=connector, startup_timeout_s=120.0)


def _inputs(conn, num_tokens, *, favor_rank=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, MODEL.hidden_size, generator=gen).to(torch.bfloat16).to(conn.device)
    logits = torch.randn(num_tokens, MODEL.num_experts, generator=gen)
    if favor_rank is not None:
        owned = conn.topology.owned_experts(favor_rank)
        logits[:, owned.start:owned.stop] += 50.0
    weights, ids = conn.select_experts(logits.to(conn.device))
    return hidden, ids, weights


def _identity_error(out, hidden, weights) -> float:
    """Max abs error of a round trip through identity experts (this file's model has no shared
    expert): out = hidden * sum_k w_k."""
    return float((out.float() - hidden.float() * weights.float().sum(dim=1, keepdim=True)).abs().max())


def _identity_round_trip(conn, hidden, ids, weights, layer) -> float:
    """One blocking round trip of layer ``layer`` and its :func:`_identity_error`."""
    return _identity_error(conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, layer)), hidden, weights)


# --- capacity --------------------------------------------------------------------------------
def _capacity_program(ctx, backend, wire_mode):
    # 2A1F... with F = 2: routed_cap = ceil(16*2/2 * 0.5) = 8; 8 tokens x top-2 all on rank 0 = 16,
    # 4 tokens = 8 = exactly the cap (in dedup mode the cap bounds the FFN's expanded staging)
    conn, role, role_rank = _connect(ctx, backend, 2, 2, ConnectorConfig(routed_cap_multiplier=0.5,
                                                                         wire_mode=wire_mode))
    try:
        if role is Role.FFN:
            worker = FFNWorker(conn, expert_fn=identity_experts)
            history = []
            fn = worker.expert_fn
            worker.expert_fn = lambda item: (history.append((item.src_rank, item.num_tokens)), fn(item))[1]
            worker.run()
            return {"history": history}
        out = {}
        if role_rank == 0:
            hidden, ids, weights = _inputs(conn, 4, favor_rank=0)
            out["at_cap_err"] = _identity_round_trip(conn, hidden, ids, weights, 0)
            hidden, ids, weights = _inputs(conn, 8, favor_rank=0)
            try:
                # cuda: a non-blocking receive raises nothing; the error latched by layer 5's
                # dispatch surfaces at the next blocking call (layer 0) and names layer 5
                handle = conn.send_attn_output(hidden, ids, weights, 5)
                conn.recv_ffn_output(handle, blocking=False)
                small = _inputs(conn, 5, seed=99)
                conn.recv_ffn_output(conn.send_attn_output(*small, 0))
            except CapacityError as err:
                out["error"] = (str(err), err.counts, err.cap, err.layer_idx)
        for layer in range(3):  # both replicas keep being served afterwards
            hidden, ids, weights = _inputs(conn, 5, seed=layer + 10 * role_rank)
            out.setdefault("max_err", []).append(_identity_round_trip(conn, hidden, ids, weights, layer))
        conn.announce_shutdown()
        return out
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_capacity_overflow_raises_writes_nothing_and_service_continues(backend, wire_mode):
    a0, a1, f0, f1 = launch(_capacity_program, 4, args=(backend, wire_mode), timeout_s=120)
    message, counts, cap, layer = a0["error"]
    assert counts == 16 and cap == 8 and layer == 5
    assert re.search(r"16 routed partials for FFN rank 0 for layer 5 > routed_cap=8", message)
    assert a0["at_cap_err"] < 0.05  # exactly at the cap is fine
    tokens = sorted(num_tokens for _, num_tokens in f0["history"] + f1["history"])
    assert f0["history"].count((0, 4)) == 1 and tokens[0] == 4 and set(tokens[1:]) == {5}  # nothing of the 8
    assert len(f0["history"]) == 7 and max(a0["max_err"] + a1["max_err"]) < 0.05


# --- the caller's routing dtypes and bad ids --------------------------------------------------
ROUTING_DTYPES = ((torch.int32, torch.float32), (torch.int64, torch.float32), (torch.int32, torch.bfloat16),
                  (torch.int16, torch.float64))


def _routing_program(ctx, backend, wire_mode):
    """1A1F, identity experts: round trips with every routing dtype the API takes (cuda: int32
    ids read as they are, int64 / bf16 / other dtypes converted on the device or by torch), then
    an out-of-range id as int32 and as int64 (one an int32 cast would wrap), each refused with
    nothing sent, then a round trip that still works."""
    conn, role, _ = _connect(ctx, backend, 1, 1, ConnectorConfig(wire_mode=wire_mode))
    try:
        if role is Role.FFN:
            worker = FFNWorker(conn, expert_fn=identity_experts)
            served = []
            fn = worker.expert_fn
            worker.expert_fn = lambda item: (served.append(item.layer_idx), fn(item))[1]
            worker.run()
            return {"served": served}
        out = {"err": [], "refused": []}
        for layer, (ids_dtype, weights_dtype) in enumerate(ROUTING_DTYPES):
            hidden, ids, weights = _inputs(conn, 5, seed=layer)
            weights = weights.to(weights_dtype)
            out["err"].append(_identity_round_trip(conn, hidden, ids.to(ids_dtype), weights, layer))
        for layer, (bad, ids_dtype) in enumerate(((MODEL.num_experts, torch.int32), (2**31 + 1, torch.int64)), 4):
            hidden, ids, weights = _inputs(conn, 3, seed=layer)
            ids = ids.to(ids_dtype)
            ids[1, 0] = bad
            try:
                conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, layer))
            except InvalidRoutingError as err:
                out["refused"].append((layer, str(err)))
        hidden, ids, weights = _inputs(conn, 4, seed=7)
        out["after"] = _identity_round_trip(conn, hidden, ids, weights, 6)
        conn.announce_shutdown()
        return out
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_routing_dtypes_and_bad_ids_end_to_end(backend, wire_mode):
    attention, ffn = launch(_routing_program, 2, args=(backend, wire_mode), timeout_s=120)
    assert max(attention["err"]) < 0.05 and attention["after"] < 0.05
    assert [layer for layer, _ in attention["refused"]] == [4, 5]
    assert all("outside [0, 4)" in text and "nothing was sent" in text for _, text in attention["refused"])
    assert ffn["served"] == [0, 1, 2, 3, 6]  # nothing of the refused dispatches reached the FFN


# --- peer timeout and shutdown from the FFN side -----------------------------------------------
def _silent_ffn_program(ctx, backend, mode, wire_mode="pair"):
    conn, role, _ = _connect(ctx, backend, 1, 1, ConnectorConfig(wire_mode=wire_mode), timeout_s=1.5)
    try:
        if role is Role.FFN:
            item = None
            while item is None:
                item = conn.recv_ffn_work_item(100)
            if mode == "shutdown":
                conn.announce_shutdown()  # never replies: the Attention side must not hang
            ctx.store().get("attention-done")
            return {"got": item.routed_tokens}
        hidden, ids, weights = _inputs(conn, 6)
        handle = conn.send_attn_output(hidden, ids, weights, 3)
        try:
            conn.recv_ffn_output(handle)
            result = {"error": None}
        except (PeerTimeoutError, ConnectorShutdown) as err:
            result = {"error": type(err).__name__, "text": str(err),
                      "peer": getattr(err, "peer", None), "layer": getattr(err, "layer_idx", None)}
        ctx.store().set("attention-done", b"1")
        return result
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_peer_timeout_names_peer_layer_and_seq(backend, wire_mode):
    attn, ffn = launch(_silent_ffn_program, 2, args=(backend, "silent", wire_mode), timeout_s=120)
    assert attn["error"] == "PeerTimeoutError", attn
    assert "FFN rank 0" in attn["text"] and "layer 3" in attn["text"] and "seq 1" in attn["text"]
    assert attn["peer"] == 0 and attn["layer"] == 3 and ffn["got"] == 12


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_shutdown_from_ffn_side_ends_attention_wait(backend, wire_mode):
    attn, _ = launch(_silent_ffn_program, 2, args=(backend, "shutdown", wire_mode), timeout_s=120)
    assert attn["error"] == "ConnectorShutdown" and "FFN rank 0" in attn["text"]


# --- shutdown from the Attention side, timeouts of the FFN poll, cleanup ------------------------
def _shutdown_program(ctx, backend, wire_mode):
    conn, role, role_rank = _connect(ctx, backend, 2, 1, ConnectorConfig(wire_mode=wire_mode))
    try:
        if role is Role.FFN:
            assert conn.recv_ffn_work_item(50) is None  # poll timeout returns None
            ctx.store().set("ffn-polled", b"1")
            served = FFNWorker(conn, expert_fn=identity_experts).run()
            return {"served": served}
        ctx.store().get("ffn-polled")  # no dispatch before the FFN's empty poll
        hidden, ids, weights = _inputs(conn, 3, seed=role_rank)
        conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
        conn.announce_shutdown()
        return {}
    finally:
        conn.close()
        if backend == "host":
            assert not os.path.exists(segment_path(ctx.job_id, "window0", ctx.rank))


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_shutdown_from_every_attention_rank_ends_ffn_loop_and_frees(backend, wire_mode):
    results = launch(_shutdown_program, 3, args=(backend, wire_mode), timeout_s=120, job_id="afdshut")
    assert results[2]["served"] == 2
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("afd_afdshut")]
