"""The teacher-forced logit comparison of tools/hf_generate.py (afd_cupy.testing.logit_check) on
synthetic logits: errors within the dtype's tolerance pass, a greedy flip at a near-tie passes,
a flip across a wide margin or an error above tolerance fails, and a step above tolerance
passes only when a router near-tie explains it."""
from __future__ import annotations

import pytest
import torch

from afd_cupy.testing import logit_check

TOL = logit_check.LOGIT_TOLERANCE


def _logits(seed: int, vocab: int = 96) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _noise(ref: torch.Tensor, size: float, seed: int) -> torch.Tensor:
    """ref + a perturbation whose largest entry is ``size`` * rms(ref)."""
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
    return ref + noise / noise.abs().max() * size * ref.pow(2).mean().sqrt()


def _with_tie(ref: torch.Tensor, margin: float) -> tuple[torch.Tensor, int, int]:
    """ref with its top-2 margin set to about ``margin`` * rms; (logits, best, runner-up)."""
    out = ref.clone()
    best, second = (int(i) for i in out.topk(2).indices)
    out[best] = out[second] + margin * out.pow(2).mean().sqrt()
    return out, best, second


def _margin(ref: torch.Tensor, a: int, b: int) -> float:
    ref = ref.double()
    return float((ref[a] - ref[b]) / ref.pow(2).mean().sqrt())


def test_errors_are_scaled_by_the_reference_logits_rms():
    ref = _logits(0) * 37.0
    got = ref.clone()
    got[5] += 0.25 * ref.pow(2).mean().sqrt()
    assert logit_check.scaled_error(got, ref) == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize("dtype", sorted(TOL))
def test_steps_within_tolerance_pass_and_one_above_fails(dtype):
    refs = [_logits(seed) for seed in range(4)]
    gots = [_noise(ref, 0.5 * TOL[dtype], seed + 10) for seed, ref in enumerate(refs)]
    result = logit_check.check_generation(refs, gots, dtype)
    assert result["ok"] and result["tolerance"] == TOL[dtype]
    assert all(step["margin"] is None and step["error"] <= TOL[dtype] for step in result["steps"])
    gots[2] = _noise(refs[2], 1.5 * TOL[dtype], 99)
    result = logit_check.check_generation(refs, gots, dtype)
    assert [step["ok"] for step in result["steps"]] == [True, True, False, True] and not result["ok"]
    assert "no routing decision differs" in result["steps"][2]["why"]


def test_a_greedy_flip_at_a_near_tie_passes_and_reports_its_margin():
    tol = TOL["bfloat16"]
    ref, best, second = _with_tie(_logits(1), 0.4 * tol)
    got = ref.clone()
    got[second] += 0.8 * tol * ref.pow(2).mean().sqrt()  # an error of 0.8 tol swaps the two
    step = logit_check.check_generation([ref], [got], "bfloat16")["steps"][0]
    assert (step["ref_token"], step["token"]) == (best, second)
    assert step["ok"] and step["why"] == "near-tie flip"
    assert step["margin"] == pytest.approx(_margin(ref, best, second), rel=1e-9) and 0 < step["margin"] < 2 * tol


def test_a_greedy_flip_across_a_wide_margin_fails():
    tol = TOL["float32"]
    ref, best, second = _with_tie(_logits(2), 5 * tol)
    got = ref.clone()
    got[second] += 6 * tol * ref.pow(2).mean().sqrt()
    step = logit_check.check_generation([ref], [got], "float32")["steps"][0]
    assert (step["ref_token"], step["token"]) == (best, second) and not step["ok"]
    assert step["margin"] == pytest.approx(_margin(ref, best, second), rel=1e-9) and step["margin"] > 2 * tol
    assert f"tokens {best} -> {second} at a margin of" in step["why"]


def _routing(ids_rows, logits_seed: int, router_noise: float = 0.0):
    """One step's routing: two layers, 3 tokens, 8 experts; layer 1's ids are ``ids_rows``."""
    layers = []
    for layer, ids in enumerate(([[0, 1], [2, 3], [4, 5]], ids_rows)):
        logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(logits_seed + layer))
        layers.append((logits, torch.tensor(ids)))
    if router_noise:
        logits, ids = layers[1]
        layers[1] = (_noise(logits, router_noise, 5), ids)
    return layers


def test_a_step_above_tolerance_passes_only_when_a_router_near_tie_explains_it():
    tol = TOL["bfloat16"]
    ref = _logits(3)
    got = _noise(ref, 4 * tol, 7)
    same = [[1, 0], [2, 3], [4, 6]]
    flipped = [[0, 1], [2, 3], [4, 7]]  # token 2 of layer 1 picks expert 7 instead of 6
    ref_routing = [_routing(same, 20)]
    # same routing in both runs: nothing explains the error
    step = logit_check.check_generation([ref], [got], "bfloat16", ref_routing, [_routing(same, 20)])["steps"][0]
    assert not step["ok"] and step["routing_flip"] is None
    # layer 1 routes token 2 elsewhere while the router logits agree within tol: a near-tie
    near = [_routing(flipped, 20, router_noise=0.5 * tol)]
    step = logit_check.check_generation([ref], [got], "bfloat16", ref_routing, near)["steps"][0]
    assert step["ok"] and step["routing_flip"]["layer"] == 1 and step["routing_flip"]["token"] == 2
    assert step["why"].startswith("routing near-tie: layer 1 token 2")
    # the same flip after router logits that already disagree beyond tol: a defect upstream
    far = [_routing(flipped, 20, router_noise=3 * tol)]
    step = logit_check.check_generation([ref], [got], "bfloat16", ref_routing, far)["steps"][0]
    assert not step["ok"] and "follows router logits" in step["why"]


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="no logit tolerance for dtype 'float16'"):
        logit_check.check_generation([_logits(0)], [_logits(0)], "float16")
    with pytest.raises(ValueError, match="1 steps against 2 reference steps"):
        logit_check.check_generation([_logits(0), _logits(1)], [_logits(0)], "float32")
    with pytest.raises(ValueError, match="routing of 1 layers against 2"):
        logit_check.first_routing_flip(_routing([[0, 1]] * 3, 0), _routing([[0, 1]] * 3, 0)[:1])
