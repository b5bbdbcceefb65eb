"""CPU checks of afd_cupy.step_graph: what cannot be captured is a ConfigError naming the
values, raised before anything touches a GPU (a stand-in connector, and one real host-backend
connector); replay's input checks; the stand-in model's shapes. The capture itself:
tests/test_step_graph_cuda.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from afd_cupy.errors import ConfigError, ProtocolError
from afd_cupy.step_graph import DecodeStepGraph, check_capturable
from afd_cupy.testing.step_model import LinearStandIn
from afd_cupy.topology import Role


def _conn(role=Role.ATTENTION, backend="cuda", poll_mode="device", token_cap=16, num_layers=4, pending=()):
    """The attributes of an AFDConnector that the checks read."""
    return SimpleNamespace(role=role, backend=backend, path=SimpleNamespace(ctx=SimpleNamespace(poll_mode=poll_mode)),
                           layout=SimpleNamespace(token_cap=token_cap), model=SimpleNamespace(num_layers=num_layers),
                           _pending={ring: None for ring in pending})


def _fns(n):
    return [lambda x: x] * n


@pytest.mark.parametrize("conn,tokens,layers,match", [
    (_conn(backend="host"), 8, 2, r"backend='host': only the cuda backend"),
    (_conn(poll_mode="host"), 8, 2, r"poll_mode='host': a captured receive must wait on the device"),
    (_conn(role=Role.FFN), 8, 2, r"Attention-side connector, got role 'ffn'"),
    (_conn(token_cap=16), 17, 2, r"num_tokens=17 must be an int in \[1, token_cap=16\]"),
    (_conn(), 0, 2, r"num_tokens=0 must be"),
    (_conn(), 4.0, 2, r"num_tokens=4.0 must be"),
    (_conn(num_layers=4), 8, 5, r"5 layers in the step: must be in \[1, model.num_layers=4\]"),
    (_conn(), 8, 0, r"0 layers in the step"),
])
def test_what_cannot_be_captured_is_a_config_error(conn, tokens, layers, match):
    with pytest.raises(ConfigError, match=match):
        check_capturable(conn, tokens, layers)
    with pytest.raises(ConfigError, match=match):  # the constructor checks first, on the CPU
        DecodeStepGraph(conn, _fns(layers), _fns(layers), num_tokens=tokens)


def test_capturable_arguments_pass_the_check():
    check_capturable(_conn(token_cap=16, num_layers=4), 16, 4)
    check_capturable(_conn(token_cap=16, num_layers=4), 1, 1)


def test_constructor_argument_mismatches():
    conn = _conn()
    with pytest.raises(ConfigError, match="3 attention callables but 2 routers"):
        DecodeStepGraph(conn, _fns(3), _fns(2), num_tokens=4)
    with pytest.raises(ConfigError, match="1 e_score_correction_bias entries for 2 layers"):
        DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=4, e_score_correction_bias=[None])
    with pytest.raises(ConfigError, match="warmup must be an int >= 1"):
        DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=4, warmup=0)
    with pytest.raises(ProtocolError, match=r"capture: dispatch\(es\) of this connector pending on ring\(s\) \[0\]"):
        DecodeStepGraph(_conn(pending=(0,)), _fns(2), _fns(2), num_tokens=4)


def test_replay_input_checks_and_pending_rings():
    step = DecodeStepGraph.__new__(DecodeStepGraph)  # the checks only: no graph on the CPU
    step.input, step.num_tokens, step.rings = torch.zeros(4, 8, dtype=torch.bfloat16), 4, {0}
    step.connector = _conn(pending=(1,))  # a pending eager dispatch on a ring the graph does not use
    assert step._check_hidden(torch.zeros(3, 8, dtype=torch.bfloat16)) == 3
    step._check_no_pending("replay")
    for bad, match in ((torch.zeros(5, 8, dtype=torch.bfloat16), r"must be \[n <= 4, 8\], got torch.Size\(\[5, 8\]\)"),
                       (torch.zeros(4, 7, dtype=torch.bfloat16), r"must be \[n <= 4, 8\]"),
                       (torch.zeros(4, 8), r"hidden is torch.float32 on cpu, the step's input is torch.bfloat16"),
                       ([[0.0] * 8], r"got list")):
        with pytest.raises(ValueError, match=match):
            step.replay(bad)
    step.connector = _conn(pending=(0,))
    with pytest.raises(ProtocolError, match=r"replay: dispatch\(es\) .* ring\(s\) \[0\]"):
        step.replay(torch.zeros(4, 8, dtype=torch.bfloat16))


def test_linear_stand_in_shapes_and_determinism():
    a = LinearStandIn(3, 16, 4, dtype=torch.bfloat16, device="cpu", seed=1)
    b = LinearStandIn(3, 16, 4, dtype=torch.bfloat16, device="cpu", seed=1, shared_weights=True)
    x = torch.randn(5, 16).to(torch.bfloat16)
    residual, h = a.attention_fns()[2](x)
    assert residual.shape == h.shape == (5, 16) and residual.dtype == torch.bfloat16
    assert torch.equal(h, residual * 0.5)
    logits = a.router_fns()[1](h)
    assert logits.shape == (5, 4) and logits.dtype == torch.float32
    assert torch.equal(a.w[0], b.w[0]) and b.w[2] is b.w[0] and not torch.equal(a.w[2], a.w[0])


def _host_rank(ctx):
    from afd_cupy.config import ModelConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn_worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts

    model = ModelConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                        num_shared_experts=0, dtype="bfloat16", max_num_batched_tokens=8, num_layers=2)
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1), role=role, role_rank=0, store=ctx.store(),
                        job_id=ctx.job_id, backend="host")
    try:
        if role == "ffn":
            return FFNWorker(conn, expert_fn=identity_experts).run()
        try:
            DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=4)
        except ConfigError as exc:
            return str(exc)
        finally:
            conn.announce_shutdown()
        return "no error"
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_a_real_host_connector_is_refused():
    from afd_cupy.launch import launch

    attn, served = launch(_host_rank, 2, timeout_s=100)
    assert "backend='host': only the cuda backend" in attn and served == 0
