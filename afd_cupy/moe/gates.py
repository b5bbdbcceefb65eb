"""Gates: router logits -> (topk_weights, topk_ids), for every common MoE family.

- plain top-k with softmax or sigmoid scores, renormalised or not (Mixtral, Qwen, OLMoE);
- DeepSeek grouped top-k: V2's group-limited greedy (groups scored by their best expert) and
  V3's ``noaux_tc`` (groups scored by the sum of their two best biased scores, the bias
  ``e_score_correction_bias`` steering the selection only).

:func:`select_experts` takes the options explicitly; :func:`model_gate` applies the gate a
``ModelConfig`` describes (what ``AFDConnector.select_experts`` calls). The weights never
include ``routed_scaling_factor``: the FFN side applies it (``moe.apply_routed_scaling``).
No host synchronization; safe inside CUDA graph capture.

On CUDA logits the greedy gate (no groups) runs as one RawKernel by default
(``impl="auto"``, :mod:`afd_cupy.backends.cuda_gate`); ``impl="torch"`` keeps torch's ops.
:func:`gate_topk_reference` is the kernel's numpy twin.
"""
from __future__ import annotations

import numpy as np
import torch

from afd_cupy.config import SCORING_FUNCS


def select_experts(router_logits: torch.Tensor, top_k: int, *, use_grouped_topk: bool = False,
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   scoring_func: str = "softmax",
                   e_score_correction_bias: torch.Tensor | None = None,
                   renormalize: bool = True,
                   group_score: str | None = None,
                   impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to `top_k` experts.

    router_logits: [num_tokens, num_experts] fp32/bf16/fp16, any device.
    e_score_correction_bias: [num_experts] float, same device, or None.
    Returns (topk_weights [num_tokens, top_k] fp32, topk_ids [num_tokens, top_k] int32), on
    router_logits' device, each row ordered by decreasing selection score.

    - Plain top-k (Mixtral, Qwen): scores = softmax (or sigmoid) of the logits in fp32,
      the `top_k` best experts.
    - `use_grouped_topk` (DeepSeek-V2/V3): experts form `num_expert_group` equal groups;
      only the `topk_group` best groups compete. A group's score is `group_score`: "max"
      (its best expert's score, V2 group_limited_greedy) or "top2_sum" (the sum of its two
      best selection scores, V3 noaux_tc); None picks "top2_sum" when a bias is given.
    - The bias only steers the selection: weights are always the unbiased scores.
    - `renormalize` divides the weights by their sum per token.
    `num_expert_group` and `topk_group` are ignored unless `use_grouped_topk`.
    `impl`: "auto" (default) runs the greedy gate on CUDA logits as one kernel
    (``backends.cuda_gate``: the same weights up to float rounding, the same ids except on
    ties after rounding, where it takes the lower id) and everything else with torch's ops;
    "torch" always uses torch's ops; "kernel" requires the kernel (ValueError saying why it
    cannot run).
    No host synchronization; safe inside CUDA graph capture.
    """
    _check_gate_args(router_logits, top_k, use_grouped_topk, num_expert_group, topk_group,
                     scoring_func, e_score_correction_bias)
    if impl not in GATE_IMPLS:
        raise ValueError(f"impl must be one of {GATE_IMPLS}, got {impl!r}")
    if impl != "torch":
        reason = "the grouped gates run with torch's ops" if use_grouped_topk else None
        if reason is None:
            from afd_cupy.backends import cuda_gate

            reason = cuda_gate.unsupported_reason(router_logits, top_k, e_score_correction_bias)
            if reason is None:
                return cuda_gate.select_experts(router_logits, top_k, scoring_func=scoring_func,
                                                bias=e_score_correction_bias, renormalize=renormalize)
        if impl == "kernel":
            raise ValueError(f"select_experts(impl='kernel') cannot run the kernel: {reason}")
    if group_score is None:
        group_score = "top2_sum" if e_score_correction_bias is not None else "max"
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    scores = _expert_scores(router_logits.float(), scoring_func)
    selection = scores
    if e_score_correction_bias is not None:
        selection = scores + e_score_correction_bias.float()
    if use_grouped_topk:
        selection = _mask_losing_groups(selection, num_expert_group, topk_group,
                                        use_top2_sum=group_score == "top2_sum")
    topk_ids = torch.topk(selection, top_k, dim=-1, sorted=True).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


#: how a group of experts is scored by the grouped gates
GROUP_SCORES = ("max", "top2_sum")
#: select_experts(impl=...): "auto" (the kernel where it applies), "torch", "kernel"
GATE_IMPLS = ("auto", "torch", "kernel")


def gate_topk_reference(logits, top_k: int, *, scoring_func: str = "softmax", bias=None,
                        renormalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of ``afd_gate_topk`` (raw_kernels/model/gate.cu), the greedy gate in float32.

    ``logits`` [T, E] (any float, read as float32), ``bias`` [E] or None. Scores: softmax
    (``exp(x - max) / sum``) or sigmoid (``1 / (1 + exp(-x))``); selection = scores + bias, a
    NaN selection below every number; the ``top_k`` best by selection, equal selections in
    increasing expert id; weights = their unbiased scores, divided by their sum (summed in k
    order) when ``renormalize``. Returns (weights float32 [T, K], ids int32 [T, K]).
    """
    scores = gate_scores_reference(logits, scoring_func)
    with np.errstate(invalid="ignore"):
        sel = scores if bias is None else scores + np.asarray(bias, dtype=np.float32)
    sel = np.where(np.isnan(sel), -np.inf, sel).astype(np.float32)
    expert = np.broadcast_to(np.arange(scores.shape[1]), sel.shape)
    order = np.lexsort((expert, -sel), axis=-1)
    ids = order[:, :top_k].astype(np.int32)
    weights = np.take_along_axis(scores, ids, axis=1).astype(np.float32)
    if renormalize:
        weights = weights / np.cumsum(weights, axis=1, dtype=np.float32)[:, -1:]
    return weights, ids


def gate_scores_reference(logits, scoring_func: str = "softmax") -> np.ndarray:
    """float32 [T, E] scores of ``gate_topk_reference``: softmax (``exp(x - max) / sum``) or
    sigmoid (``1 / (1 + exp(-x))``) of ``logits`` read as float32."""
    x = np.asarray(logits, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if scoring_func == "softmax":
            e = np.exp(x - x.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True, dtype=np.float32)
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def model_gate(model, router_logits: torch.Tensor,
               e_score_correction_bias: torch.Tensor | None = None, *, impl: str = "auto"):
    """``select_experts`` with the gate ``model`` (a ModelConfig) describes.

    ``model.topk_method``: "greedy" (plain top-k, groups ignored), "group_limited_greedy"
    (DeepSeek-V2: groups scored by their best expert), "noaux_tc" (DeepSeek-V3: groups scored
    by the sum of their two best biased scores; a missing bias counts as zeros), or None
    (group_limited_greedy when ``n_group`` is set, else greedy). ``renormalize`` is
    ``norm_topk_prob``. The weights exclude ``routed_scaling_factor`` (the FFN side applies
    it). Returns (weights fp32 [T, K], ids int32 [T, K]) on the logits' device; no host sync.
    ``impl``: as :func:`select_experts` ("auto": the one-kernel gate for a greedy gate on CUDA).
    """
    method = model.topk_method or ("group_limited_greedy" if model.n_group else "greedy")
    grouped = method != "greedy"
    bias = e_score_correction_bias
    if method == "noaux_tc" and bias is None:
        bias = torch.zeros(model.num_experts, device=router_logits.device)
    return select_experts(
        router_logits, model.top_k, use_grouped_topk=grouped,
        num_expert_group=model.n_group if grouped else None,
        topk_group=model.topk_group if grouped else None, scoring_func=model.scoring_func,
        e_score_correction_bias=bias, renormalize=model.renormalize,
        group_score={"greedy": None, "group_limited_greedy": "max", "noaux_tc": "top2_sum"}[method],
        impl=impl)


def _expert_scores(logits_fp32: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "softmax":
        return torch.softmax(logits_fp32, dim=-1)
    return torch.sigmoid(logits_fp32)


def _mask_losing_groups(selection: torch.Tensor, num_expert_group: int, topk_group: int, *,
                        use_top2_sum: bool) -> torch.Tensor:
    """selection [T, E] fp32 -> same with -inf on experts of groups that were not kept."""
    num_tokens, num_experts = selection.shape
    grouped = selection.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if use_top2_sum:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    kept_groups = torch.topk(group_scores, topk_group, dim=-1).indices
    is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    # -inf, not 0: biased scores can be negative, so 0 could still win.
    return grouped.masked_fill(~is_kept.unsqueeze(-1), float("-inf")).view(num_tokens, -1)


def _check_gate_args(router_logits, top_k, use_grouped_topk, num_expert_group, topk_group,
                     scoring_func, bias) -> None:
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError("router_logits must be a 2-D float tensor [num_tokens, num_experts], "
                         f"got shape {tuple(router_logits.shape)} dtype {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"e_score_correction_bias must have shape ({num_experts},) "
                         f"(num_experts), got {tuple(bias.shape)}")
    if use_grouped_topk:
        _check_groups(num_experts, top_k, num_expert_group, topk_group, bias is not None)


def _check_groups(num_experts, top_k, num_expert_group, topk_group, has_bias) -> None:
    if num_expert_group is None or num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group must divide num_experts={num_experts}, "
                         f"got num_expert_group={num_expert_group}")
    if topk_group is None or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}], "
                         f"got topk_group={topk_group}")
    group_size = num_experts // num_expert_group
    if top_k > topk_group * group_size:
        raise ValueError(f"top_k={top_k} exceeds the experts of the kept groups: "
                         f"topk_group={topk_group} * group size {group_size}")
    if has_bias and group_size < 2:
        raise ValueError("e_score_correction_bias scores a group by its top-2 experts: the "
                         f"group size must be >= 2, got num_experts={num_experts} / "
                         f"num_expert_group={num_expert_group} = {group_size}")
