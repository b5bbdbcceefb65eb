"""What the ranks of the multi-process fault tests run: one connector per rank, seeded inputs,
the FFN's next item, an identity round trip, and the bad-input program.

Programs are pickled by reference into spawned ranks (``afd_cupy.runtime.launch``), which import
``helpers.programs`` through the ``sys.path`` they inherit from the pytest process.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.testing.reference import identity_experts

#: "device" or "host" (the GPU suite reruns the cuda cases with AFD_TEST_POLL_MODE=host)
POLL_MODE = os.environ.get("AFD_TEST_POLL_MODE", "device")
#: 8 layers, 4 experts, top-2, one shared expert, 16 tokens at most
FAULT_MODEL = ModelConfig(hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16,
                          num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=16,
                          num_layers=8)
#: the fault tests' peer timeout (s): a slow peer sleeps 1.6 x this
FAULT_TIMEOUT_S = 1.0


def connect(ctx, backend, num_attn=1, num_ffn=1, *, model=FAULT_MODEL, timeout_s=FAULT_TIMEOUT_S,
            connector=None, startup_timeout_s=30.0, **extra):
    """(AFDConnector, role, role_rank) of launch rank ``ctx.rank`` in an ``num_attn``A``num_ffn``F
    job; ``backend`` "cuda-put" is the cuda backend with ``transport="put"``."""
    role, role_rank = Topology(num_attn, num_ffn, model.num_experts).role_of(ctx.rank)
    if backend == "cuda-put":
        backend, connector = "cuda", dataclasses.replace(connector or ConnectorConfig(), transport="put")
    if backend == "cuda":
        torch.cuda.set_device(ctx.device_id or 0)
    return AFDConnector(model, TopologyConfig(num_attn, num_ffn), connector, role=role,
                        role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id, backend=backend,
                        device_id=ctx.device_id, poll_mode=POLL_MODE, peer_timeout_s=timeout_s,
                        startup_timeout_s=startup_timeout_s, **extra), role, role_rank


def seeded_inputs(conn, num_tokens, seed):
    """(hidden [num_tokens, H] payload dtype, topk_ids, topk_weights) on the connector's device,
    from ``seed`` (the gate runs through ``conn.select_experts``)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, conn.model.hidden_size, generator=gen).to(conn.torch_dtype)
    logits = torch.randn(num_tokens, conn.model.num_experts, generator=gen)
    weights, ids = conn.select_experts(logits.to(conn.device))
    return hidden.to(conn.device), ids, weights


def next_item(conn):
    """The FFN's next work item, polling until one arrives (the launch bounds the test)."""
    item = None
    while item is None:
        item = conn.recv_ffn_work_item(100)
    return item


def round_trip_error(conn, layer, seed, num_tokens=6) -> float:
    """One layer through identity experts; max abs error against hidden * (sum w + 1) (the +1:
    FAULT_MODEL's one shared expert)."""
    hidden, ids, weights = seeded_inputs(conn, num_tokens, seed)
    out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, layer))
    expect = hidden.float() * (weights.float().sum(dim=1, keepdim=True) + 1.0)
    return float((out.float() - expect).abs().max())


def error_of(fn) -> tuple:
    """(exception type name, message) that ``fn()`` raises, or (None, "")."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test inspects type and text
        return type(err).__name__, str(err)
    return None, ""


def bad_input_program(ctx, backend) -> dict:
    """1A1F: the Attention rank feeds every kind of bad input, each answered by an error (type,
    message) while the connector keeps working; the FFN rank serves with identity experts.

    Tensor checks: wrong hidden width/dtype, ids/weights shape/dtype, stage out of range, too
    many tokens, a call of the wrong role, a second send on a busy ring, a handle received
    twice. Routing and layer checks: layer out of range or not an int, bool ids, gate logits
    of the wrong width, ids that an int32 cast would wrap, a send after announce_shutdown.
    Two sends succeed ("ok", "after"), so the FFN serves 2 items."""
    conn, role, _ = connect(ctx, backend, timeout_s=10.0)
    try:
        if role is Role.FFN:
            return {"served": FFNWorker(conn, expert_fn=identity_experts).run()}
        hidden, ids, weights = seeded_inputs(conn, 4, seed=1)
        send, device, out = conn.send_attn_output, conn.device, {}
        out["shape"] = error_of(lambda: send(hidden[:, :5], ids, weights, 0))
        out["dtype"] = error_of(lambda: send(hidden.float(), ids, weights, 0))
        out["ids"] = error_of(lambda: send(hidden, ids[:3], weights, 0))
        out["weights_dtype"] = error_of(lambda: send(hidden, ids, ids, 0))
        out["stage"] = error_of(lambda: send(hidden, ids, weights, 0, stage_idx=1))
        out["tokens"] = error_of(lambda: send(torch.zeros(17, 32, dtype=torch.bfloat16, device=device),
                                              torch.zeros(17, 2, dtype=torch.int32, device=device),
                                              torch.ones(17, 2, device=device), 0))
        out["wrong_role"] = error_of(lambda: conn.recv_ffn_work_item(1))
        handle = send(hidden, ids, weights, 0)
        out["ring"] = error_of(lambda: send(hidden, ids, weights, 0))
        result = conn.recv_ffn_output(handle)
        out["twice"] = error_of(lambda: conn.recv_ffn_output(handle))
        out["ok"] = bool(torch.isfinite(result.float()).all())
        out["layer_high"] = error_of(lambda: send(hidden, ids, weights, FAULT_MODEL.num_layers))
        out["layer_float"] = error_of(lambda: send(hidden, ids, weights, 1.7))
        out["bool_ids"] = error_of(lambda: send(hidden, ids.bool(), weights, 0))
        out["logits_width"] = error_of(lambda: conn.select_experts(torch.zeros(4, 3, device=device)))
        wrapped = ids.to(torch.int64) + 2**32  # would route to a real expert after an int32 cast
        out["wrapped_ids"] = error_of(lambda: conn.recv_ffn_output(send(hidden, wrapped, weights, 0)))
        out["wrapped_first"] = int(wrapped[0, 0])
        out["after"] = round_trip_error(conn, 1, seed=2)
        conn.announce_shutdown()
        out["after_shutdown"] = error_of(lambda: send(hidden, ids, weights, 2))
        return out
    finally:
        conn.close()
