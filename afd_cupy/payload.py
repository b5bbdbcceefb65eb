"""Payload dtypes: torch dtypes, raw wire words, and fp32 conversion on the host.

The wire moves payload rows as raw 16- or 32-bit words, so the same bytes work for bf16
(which numpy lacks), fp16 and fp32. Arithmetic (combine) decodes to fp32.
"""
from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
RAW_WORDS = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def raw_dtype(name: str):
    """numpy dtype of one raw payload word for payload dtype ``name``."""
    return RAW_WORDS[name]


def torch_to_raw(tensor: torch.Tensor, name: str) -> np.ndarray:
    """Zero-copy numpy raw-word view of a contiguous CPU tensor of payload dtype ``name``."""
    words = torch.int16 if RAW_WORDS[name] is np.int16 else torch.int32
    return tensor.contiguous().view(words).numpy()


def raw_to_torch(raw: np.ndarray, name: str) -> torch.Tensor:
    """Zero-copy torch view (payload dtype) of numpy raw words."""
    return torch.from_numpy(raw).view(TORCH_DTYPES[name])


def raw_to_f32(raw: np.ndarray, name: str) -> np.ndarray:
    """fp32 copy of raw payload words."""
    if name == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if name == "float16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32).copy()
