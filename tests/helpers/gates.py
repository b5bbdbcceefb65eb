"""Gate inputs whose selections cannot tie (shared by the gate's CPU and GPU tests)."""
from __future__ import annotations

import numpy as np


def separated_logits(rng, num_tokens: int, num_experts: int) -> np.ndarray:
    """[T, E] float32 logits whose sorted values are evenly apart in every row (a shuffled
    ladder over [-4, 4) at most, plus noise far below the spacing): no two selections tie, even
    after rounding (sigmoid stays far from saturating in float32)."""
    spacing = min(0.05, 8.0 / num_experts)
    ladder = np.arange(num_experts, dtype=np.float32) * spacing - spacing * num_experts / 2
    rows = np.stack([rng.permutation(ladder) for _ in range(num_tokens)])
    return (rows + rng.uniform(-spacing / 100, spacing / 100, rows.shape)).astype(np.float32)
