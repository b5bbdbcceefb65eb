"""Teacher-forced comparison of two runs of one language model: the reference (the model in one
process) and the disaggregated one, both fed the same tokens (the reference's greedy tokens).
For ``afd_cupy.testing.hf_models.generation_rank`` and ``tools/hf_generate.py``.

A free-running comparison cannot tell a defect from a near-tie: once one greedy token differs,
the two runs see different sequences and every later step differs too. Teacher forcing keeps
the inputs equal, so every step is judged on its own:

- **error** of a step: ``max_v |got[v] - ref[v]| / rms(ref)``, the worst logit's deviation in
  units of the reference logits' scale (their root mean square over the vocabulary).
  ``LOGIT_TOLERANCE[dtype]`` bounds it: fp32 ``1e-4`` (fp32 arithmetic in another order:
  measured <= 2e-6 on the tiny models, host backend); bf16 ``0.2``: bf16 keeps 8 bits (one
  rounding is up to ``2**-9`` relative); without a routing change the disaggregated bf16 run
  measured up to 0.036 off the one-process bf16 run for six families and 0.083 for gpt-oss
  (its experts' gate/up values are large enough to reach the clamp), and the one-process bf16
  run itself up to 0.14 off the same weights run in fp32 (host backend). A defect worth the name (a wrong layout, activation, scaling or
  routing) moves logits by a sizeable part of their scale; the per-block tests against an
  fp64 truth (tests/integration/test_adapters.py) catch the subtle ones.
- **flip**: the greedy tokens differ. Its **margin** is ``(ref[a] - ref[b]) / rms(ref)`` with
  ``a`` the reference's token and ``b`` the other run's (the top-2 margin when ``b`` is the
  reference's runner-up). Two runs within ``tol`` of each other can swap tokens only when
  ``margin <= 2 * tol``: such a flip is a near-tie and passes; a wider one means an error above
  ``tol`` and fails (unless a routing near-tie explains it, below).
- **routing flip**: a sparse-MoE layer sends a token to other experts in the two runs. Routing
  is discrete: inputs that differ by rounding can cross a router's near-tie and move a logit by
  far more than ``tol``. A step above ``tol`` still passes when, at the first layer (forward
  order) whose expert choice differs between the runs, the router logits of the two runs agree
  within ``tol`` (of their scale): the routers saw the same input up to rounding, so the
  choice was a near-tie. A step above ``tol`` with no routing flip, or whose first routing flip
  follows router inputs that already disagree, fails.

``routing``: per step, per sparse-MoE layer in forward order, ``(router_logits [T, E] float,
topk_ids [T, K] int)`` as the layer's router computed them (its own selection), on the CPU.
"""
from __future__ import annotations

import torch

#: max |logit error| / rms(reference logits) per step, by dtype (see the module doc)
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.2}


def scaled_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / rms(ref)`` of two [V] (or [T, V]) float tensors, in float64."""
    ref64, got64 = ref.detach().double().cpu(), got.detach().double().cpu()
    scale = ref64.pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    return float((got64 - ref64).abs().max() / scale)


def first_routing_flip(ref_layers, got_layers) -> dict | None:
    """The first layer whose expert choice differs for some token, as ``{"layer", "token",
    "router_error"}`` (``router_error``: ``scaled_error`` of that layer's router logits), or None
    when every layer routes every token to the same set of experts. ValueError when the two
    runs do not have the same layers and shapes."""
    if len(ref_layers) != len(got_layers):
        raise ValueError(f"routing of {len(got_layers)} layers against {len(ref_layers)}")
    for layer, ((ref_logits, ref_ids), (got_logits, got_ids)) in enumerate(zip(ref_layers, got_layers)):
        if ref_ids.shape != got_ids.shape or ref_logits.shape != got_logits.shape:
            raise ValueError(f"layer {layer}: routing shapes {tuple(got_ids.shape)} / {tuple(got_logits.shape)} "
                             f"against {tuple(ref_ids.shape)} / {tuple(ref_logits.shape)}")
        differs = (ref_ids.long().sort(dim=-1).values != got_ids.long().sort(dim=-1).values).any(dim=-1)
        if bool(differs.any()):
            return {"layer": layer, "token": int(differs.nonzero()[0, 0]),
                    "router_error": scaled_error(got_logits, ref_logits)}
    return None


def check_step(ref: torch.Tensor, got: torch.Tensor, tol: float, ref_routing=None, got_routing=None) -> dict:
    """One teacher-forced step: ``ref`` and ``got`` are the [V] logits of the two runs.

    Returns ``{"error", "ref_token", "token", "margin" (None unless the tokens differ),
    "routing_flip" (``first_routing_flip``; None without routing or when no choice differs),
    "ok", "why"}``. A flip within ``tol`` always has ``margin <= 2 * tol``; a wider one comes
    with an error above ``tol`` and fails unless a routing near-tie explains the step.
    """
    ref_token, token = int(ref.argmax()), int(got.argmax())
    error = scaled_error(got, ref)
    margin = None
    if token != ref_token:
        ref64 = ref.detach().double().cpu()
        margin = float((ref64[ref_token] - ref64[token]) / ref64.pow(2).mean().sqrt())
    flip = None
    if ref_routing is not None and got_routing is not None:
        flip = first_routing_flip(ref_routing, got_routing)
    flipped = "" if margin is None else f"; tokens {ref_token} -> {token} at a margin of {margin:.3g}"
    if error <= tol:
        ok, why = True, "near-tie flip" if margin is not None else "within tolerance"
    elif flip is None:
        ok, why = False, f"error {error:.3g} > tol {tol:g} and no routing decision differs{flipped}"
    elif flip["router_error"] <= tol:
        ok, why = True, (f"routing near-tie: layer {flip['layer']} token {flip['token']} chose other experts "
                         f"with router logits {flip['router_error']:.3g} apart{flipped}")
    else:
        ok, why = False, (f"error {error:.3g} > tol {tol:g}; the first routing flip (layer {flip['layer']}) "
                          f"follows router logits {flip['router_error']:.3g} > tol apart{flipped}")
    return {"error": error, "ref_token": ref_token, "token": token, "margin": margin,
            "routing_flip": flip, "ok": ok, "why": why}


def check_generation(ref_logits, got_logits, dtype: str, ref_routing=None, got_routing=None) -> dict:
    """Every step of a teacher-forced comparison (lists of [V] logits, one per step; routing
    per step as in the module doc, or None). Returns ``{"tolerance", "steps": [check_step],
    "ok"}``; ValueError for an unknown dtype or lists of different lengths."""
    if dtype not in LOGIT_TOLERANCE:
        raise ValueError(f"no logit tolerance for dtype {dtype!r} (known: {sorted(LOGIT_TOLERANCE)})")
    if len(ref_logits) != len(got_logits):
        raise ValueError(f"{len(got_logits)} steps against {len(ref_logits)} reference steps")
    tol = LOGIT_TOLERANCE[dtype]
    routing = (list(zip(ref_routing, got_routing)) if ref_routing is not None and got_routing is not None
               else [(None, None)] * len(ref_logits))
    steps = [check_step(ref, got, tol, r, g) for ref, got, (r, g) in zip(ref_logits, got_logits, routing)]
    return {"tolerance": tol, "steps": steps, "ok": all(step["ok"] for step in steps)}
