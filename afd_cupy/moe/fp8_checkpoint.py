"""An FFN rank's experts from a DeepSeek-V3-style FP8 state dict (used by
``adapters.ffn_weights``; docs/design/fp8.md). Part of :mod:`afd_cupy.moe`.

The checkpoint stores every expert linear apart, ``<prefix>experts.<e>.<proj>.weight``
(``proj`` gate_proj, up_proj [I, H] and down_proj [H, I]) in E4M3 with
``<prefix>experts.<e>.<proj>.weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)] beside it
(:func:`afd_cupy.moe.fp8.dequantize_blockwise`), and the shared experts likewise under
``<prefix>shared_experts.<proj>``. Only this rank's experts are read (a memory-mapped state dict
is never materialised), converted to the rowwise format and returned as one
``FP8ExpertWeights`` per layer, or dequantized into an ``ExpertWeights`` (bf16 serving of the
checkpoint, no conversion); the shared experts are dequantized into an ``ExpertWeights`` of the
payload dtype (they run through ``moe.shared_mlp``, not in FP8).
"""
from __future__ import annotations

import re

import torch

from afd_cupy.moe import fp8
from afd_cupy.moe.expert_formats import ExpertFormat, UnsupportedModelError
from afd_cupy.moe.weights import ExpertWeights

#: the key that marks a layer's per-expert FP8 weights; group 1 is the layer's prefix
_EXPERT_SCALE_RE = re.compile(r"^(.*)experts\.(\d+)\.gate_proj\.weight_scale_inv$")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def layer_prefixes(state: dict) -> dict[str, set[int]]:
    """{prefix: expert ids} of every layer whose experts are stored per expert with
    ``weight_scale_inv`` (empty when the state dict holds none)."""
    found: dict[str, set[int]] = {}
    for key in state:
        match = _EXPERT_SCALE_RE.match(key)
        if match is not None:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    return found


def _projection(state: dict, name: str, shape: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q E4M3 [out, in], scale_inv fp32 [ceil(out/128), ceil(in/128)]) of linear ``name``,
    checked; ``shape``: the expected [out, in] (None: any)."""
    missing = [key for key in (f"{name}.weight", f"{name}.weight_scale_inv") if key not in state]
    if missing:
        raise UnsupportedModelError(f"FP8 state dict: {missing[0]!r} is missing")
    q, scale_inv = state[f"{name}.weight"], state[f"{name}.weight_scale_inv"]
    if q.dtype != fp8.FP8_DTYPE or q.dim() != 2 or (shape is not None and tuple(q.shape) != shape):
        raise UnsupportedModelError(f"FP8 state dict: {name}.weight is {tuple(q.shape)} {q.dtype}, expected "
                                    f"{'[out, in]' if shape is None else list(shape)} {fp8.FP8_DTYPE}")
    want = (fp8.num_blocks(q.shape[0]), fp8.num_blocks(q.shape[1]))
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        raise UnsupportedModelError(f"FP8 state dict: {name}.weight_scale_inv is {tuple(scale_inv.shape)} "
                                    f"{scale_inv.dtype}, expected {list(want)} torch.float32 (one per "
                                    f"128x128 block of {tuple(q.shape)})")
    return q, scale_inv.to(q.device)


def local_experts(state: dict, prefix: str, expert_ids: set[int], *, ffn_rank: int, expert_per_rank: int,
                  num_experts: int, fmt: ExpertFormat, dequantize_to: torch.dtype | None = None):
    """FFN rank ``ffn_rank``'s experts of the layer at ``prefix`` (global ids
    [r*epr, (r+1)*epr), the ids past ``num_experts`` zero experts), on the checkpoint's device:
    an ``FP8ExpertWeights`` (converted per output channel), or with ``dequantize_to`` an
    ``ExpertWeights`` of that dtype (the block-scaled weights dequantized, no conversion).
    ``expert_ids``: the ids the state dict holds for this layer (:func:`layer_prefixes`)."""
    if fmt.interleaved:
        raise UnsupportedModelError(f"{prefix}experts: FP8 experts with interleaved gate/up rows")
    if max(expert_ids) >= num_experts:
        raise UnsupportedModelError(f"{prefix}experts: expert id {max(expert_ids)} in the state dict, "
                                    f"expected {num_experts} experts")
    first = ffn_rank * expert_per_rank
    owned = range(first, min(first + expert_per_rank, num_experts))
    probe = _projection(state, f"{prefix}experts.{owned[0] if owned else min(expert_ids)}.gate_proj", None)[0]
    (inter, hidden), device = probe.shape, probe.device
    dtype = dequantize_to or fp8.FP8_DTYPE
    w13 = torch.zeros((expert_per_rank, 2 * inter, hidden), dtype=dtype, device=device)
    w2 = torch.zeros((expert_per_rank, hidden, inter), dtype=dtype, device=device)
    w13_scale = torch.ones((expert_per_rank, 2 * inter), device=device)  # padded slots: zero codes
    w2_scale = torch.ones((expert_per_rank, hidden), device=device)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    for local, expert in enumerate(owned):
        blocks = {proj: _projection(state, f"{prefix}experts.{expert}.{proj}", shapes[proj]) for proj in _PROJECTIONS}
        if dequantize_to is not None:
            parts = {proj: fp8.dequantize_blockwise(*qs).to(dequantize_to) for proj, qs in blocks.items()}
            w13[local] = torch.cat([parts["gate_proj"], parts["up_proj"]])
            w2[local] = parts["down_proj"]
            continue
        rowwise = {proj: fp8.blockwise_to_rowwise(*qs) for proj, qs in blocks.items()}
        w13[local] = torch.cat([rowwise["gate_proj"][0], rowwise["up_proj"][0]])
        w13_scale[local] = torch.cat([rowwise["gate_proj"][1], rowwise["up_proj"][1]])
        w2[local], w2_scale[local] = rowwise["down_proj"]
    if dequantize_to is not None:
        return ExpertWeights(w13=w13, w2=w2, num_experts=expert_per_rank, first_expert=first,
                             **fmt.weights_kwargs())
    return fp8.FP8ExpertWeights(w13, w13_scale, w2, w2_scale, num_experts=expert_per_rank,
                                first_expert=first, **fmt.weights_kwargs())


def shared_experts(state: dict, prefix: str, *, dtype: torch.dtype,
                   fmt: ExpertFormat) -> ExpertWeights | None:
    """The layer's shared experts (``<prefix>shared_experts.*``), dequantized to ``dtype`` as one
    fused ``ExpertWeights`` (w13 [1, 2*S*I, H], w2 [1, H, S*I]); None when it has none."""
    name = f"{prefix}shared_experts"
    if f"{name}.gate_proj.weight" not in state:
        return None
    gate, up, down = (fp8.dequantize_blockwise(*_projection(state, f"{name}.{proj}", None))
                      for proj in _PROJECTIONS)
    if gate.shape != up.shape or down.shape != gate.shape[::-1]:
        raise UnsupportedModelError(f"{name}: gate {tuple(gate.shape)}, up {tuple(up.shape)} and down "
                                    f"{tuple(down.shape)} must be [S*I, H], [S*I, H], [H, S*I]")
    return ExpertWeights(w13=torch.cat([gate, up]).unsqueeze(0).to(dtype), w2=down.unsqueeze(0).to(dtype),
                         num_experts=1, **fmt.weights_kwargs())
