"""FP8 dispatch end to end (``ConnectorConfig.dispatch_dtype="fp8_e4m3"``, docs/design/fp8.md),
in real processes through the real connector, on the host backend and (``cuda`` marker) on the
cuda backend over the direct and the put transport:

- the rows an FFN rank's experts read are exactly the numpy reference's quantize-dequantize of
  the Attention side's rows (``afd_cupy.wire.fp8``, rounded to the payload dtype), routed and
  shared, so the device's quantizer and dequantizer are checked bit for bit against it;
- with identity experts the output is the combine of those rows, and its distance to the
  unquantized output is the dispatch's error budget (DeepEP's calc_diff < 7e-4);
- with random MLP experts the FP8 run stays within the documented relative-error budget of the
  fp64 reference, next to the same run in bf16.
"""
import dataclasses

import numpy as np
import pytest
import torch

from afd_cupy import wire
from afd_cupy.config import ConnectorConfig, ModelConfig
from afd_cupy.errors import WireError
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Role
from afd_cupy.testing.scenario import Scenario, run_rank, tolerance
from afd_cupy.wire import fp8
from afd_cupy.wire.dtypes import f32_to_raw, raw_to_f32, torch_to_raw

from helpers.backends import BACKENDS, DIRECT_BACKENDS
from helpers.programs import POLL_MODE, connect, seeded_inputs

FP8 = ConnectorConfig(dispatch_dtype="fp8_e4m3")
#: relative L2 error of an AFD MoE layer's output against the fp64 reference with FP8 dispatch
#: and random experts (docs/design/fp8.md, "Dispatch error budget")
FP8_DISPATCH_REL_L2 = 0.06
#: DeepEP's acceptance bound of calc_diff for an FP8 dispatch
CALC_DIFF_BUDGET = 7e-4
LAYERS, TOKENS = 3, 24


def _model(dtype="bfloat16"):
    return ModelConfig(hidden_size=256, num_experts=8, top_k=2, moe_intermediate_size=64,
                       num_shared_experts=1, dtype=dtype, max_num_batched_tokens=32, num_layers=LAYERS)


def _reference_rows(hidden: torch.Tensor, dtype: str) -> torch.Tensor:
    """[T, H] payload rows as the FFN must see them: fp8 quantize, dequantize, round."""
    raw = torch_to_raw(hidden.detach().cpu(), dtype)
    values = fp8.dequantize_wire_rows(fp8.quantize_wire_rows(raw_to_f32(raw, dtype)), raw.shape[1])
    return torch.from_numpy(f32_to_raw(values, dtype)).view(getattr(torch, dtype))


def _seed(src_rank: int, layer: int) -> int:
    return 100 * src_rank + layer


def _identity_program(ctx, backend, num_attn, num_ffn, dtype):
    model = _model(dtype)
    conn, role, role_rank = connect(ctx, backend, num_attn, num_ffn, model=model, connector=FP8,
                                    timeout_s=60.0)
    try:
        if role is Role.FFN:
            mismatches, rows_checked = [], [0]

            def check(item):  # the experts' input against the reference, bit for bit
                hidden, _, _ = seeded_inputs(conn, TOKENS, _seed(item.src_rank, item.layer_idx))
                want = _reference_rows(hidden, dtype)
                tokens = item.route_table[:, 0].cpu().long()
                got = [(item.routed_x, want[tokens])]
                if item.shared_x is not None:
                    got.append((item.shared_x, want[role_rank::num_ffn]))
                for rows, ref in got:
                    bits = rows.cpu().view(torch.int16) != ref.view(torch.int16)
                    mismatches.append(int(bits.sum()))
                    rows_checked[0] += rows.shape[0]
                return item.routed_x, item.shared_x

            served = FFNWorker(conn, expert_fn=check).run()
            return {"role": "ffn", "served": served, "mismatches": sum(mismatches),
                    "rows": rows_checked[0]}
        errors = []
        for layer in range(LAYERS):
            hidden, ids, weights = seeded_inputs(conn, TOKENS, _seed(role_rank, layer))
            out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, layer)).float().cpu()
            factor = weights.float().cpu().sum(dim=1, keepdim=True) + 1.0  # routed + shared
            exact = hidden.float().cpu() * factor
            quantized = _reference_rows(hidden, dtype).float() * factor
            errors.append({"vs_quantized": float((out - quantized).norm() / quantized.norm()),
                           "vs_exact": float((out - exact).norm() / exact.norm()),
                           "calc_diff": fp8.calc_diff(out.numpy(), exact.numpy())})
        conn.announce_shutdown()
        return {"role": "attention", "errors": errors}
    finally:
        conn.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2)])
def test_ffn_reads_the_reference_dequantized_rows(backend, num_attn, num_ffn):
    results = launch(_identity_program, num_attn + num_ffn, args=(backend, num_attn, num_ffn, "bfloat16"),
                     timeout_s=240)
    ffn = [r for r in results if r["role"] == "ffn"]
    assert sum(r["rows"] for r in ffn) >= num_attn * LAYERS * TOKENS * 3  # top-2 + shared
    assert [r["mismatches"] for r in ffn] == [0] * num_ffn
    for report in (r for r in results if r["role"] == "attention"):
        for err in report["errors"]:
            # the combine of the dequantized rows: only the output's bf16 rounding differs
            assert err["vs_quantized"] < 4e-3, err
            # the dispatch's quantization error, far above bf16 rounding, inside DeepEP's bound
            assert 1e-2 < err["vs_exact"] < 0.05 and err["calc_diff"] < CALC_DIFF_BUDGET, err


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
def test_fp16_payload(backend):
    results = launch(_identity_program, 2, args=(backend, 1, 1, "float16"), timeout_s=240)
    assert [r["mismatches"] for r in results if r["role"] == "ffn"] == [0]


def _scenario_errors(backend, connector):
    scenario = Scenario(_model(), 2, 2, backend=backend.partition("-")[0], poll_mode=POLL_MODE,
                        num_tokens=TOKENS, connector=dataclasses.replace(
                            connector, transport=backend.partition("-")[2] or "direct"))
    results = launch(run_rank, scenario.world_size, args=(scenario,), timeout_s=240)
    errors = [e for r in results if r["role"] == "attention" for e in r["errors"]]
    assert len(errors) == 2 * LAYERS and all(e["num_nan"] == 0 and e["shape_ok"] for e in errors)
    return np.array([e["rel_err"] for e in errors])


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
def test_moe_output_within_the_error_budget_next_to_bf16(backend):
    fp8_err = _scenario_errors(backend, FP8)
    bf16_err = _scenario_errors(backend, ConnectorConfig())
    assert (bf16_err <= tolerance("bfloat16")).all(), bf16_err
    assert (fp8_err <= FP8_DISPATCH_REL_L2).all(), fp8_err
    assert fp8_err.mean() > 2 * bf16_err.mean(), (fp8_err, bf16_err)  # the rows were quantized


def _mismatch_program(ctx, backend, sender_fp8):
    """1A1F where only the Attention side (``sender_fp8``) or only the FFN side uses FP8: the
    handshake refuses the job before anything is sent."""
    mine = FP8 if (ctx.rank == 0) == sender_fp8 else ConnectorConfig()
    try:
        conn, _, _ = connect(ctx, backend, model=_model(), connector=mine, startup_timeout_s=30.0)
    except Exception as exc:  # noqa: BLE001 - the type and message are the result
        return type(exc).__name__, str(exc)
    conn.close()
    return None


@pytest.mark.parametrize("sender_fp8", [True, False])
def test_ranks_must_agree_on_the_dispatch_dtype(sender_fp8):
    results = launch(_mismatch_program, 2, args=("host", sender_fp8), timeout_s=120)
    for result in results:
        assert result is not None
        name, message = result
        assert name == "GeometryMismatchError" and "dispatch_dtype" in message, result


def test_ffn_rejects_a_dispatch_of_the_other_row_format():
    """A message whose FLAG_FP8 disagrees with the receiver is a WireError naming both formats
    (written by hand into the window: a mismatched connector is refused at start-up)."""
    results = launch(_forged_flag_program, 2, args=(), timeout_s=120)
    assert results[1][0] == "WireError", results
    assert "mark dispatch_dtype='payload' rows; this FFN rank reads dispatch_dtype='fp8_e4m3'" in results[1][1]


def _forged_flag_program(ctx):
    model = _model()
    conn, role, _ = connect(ctx, "host", model=model, connector=FP8, timeout_s=5.0)
    try:
        layout = conn.layout
        if role is Role.ATTENTION:
            header = wire.dispatch_header(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=1,
                                          shared_tokens=0, top_k=2, expert_counts=(1, 0, 0, 0, 0, 0, 0, 1))
            conn.path.rank.link.write_message(1, 0, 0, wire.encode_header(header, layout.expert_per_rank), 1)
            ctx.store().set("sent", b"1")
            ctx.store().get("done")
            return None
        try:
            while conn.recv_ffn_work_item(100) is None:
                pass
            return ("served", "")
        except WireError as exc:
            return ("WireError", str(exc))
        finally:
            ctx.store().set("done", b"1")
    finally:
        conn.close()
