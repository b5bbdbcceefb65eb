"""Payload dtypes: the one table of what each payload dtype is on the wire, in torch and in
the kernels, plus the host conversions between torch tensors and raw wire words.

The wire moves payload rows as raw 16- or 32-bit words, so the same bytes work for bf16
(which numpy lacks), fp16 and fp32. Arithmetic on the host (combine) decodes to fp32.
``kernel_code`` is the template argument of the dtype-generic kernels; ``raw_kernels/common/wire.cuh``
mirrors it as ``DT_BF16`` / ``DT_F16`` / ``DT_F32``.

torch is imported on first use of a torch dtype, so validating a config needs no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

import numpy as np

from afd_cupy.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PayloadDtype:
    """One payload dtype.

    name: torch's name of the dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
    raw_word: numpy integer type of one raw wire word of the same width (np.int16 / np.int32).
    itemsize: bytes per element.
    kernel_code: the kernels' dtype template argument (``DT_*`` in ``raw_kernels/common/wire.cuh``).
    """

    name: str
    raw_word: type
    itemsize: int
    kernel_code: int

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The torch dtype of the payload (``torch.bfloat16`` for ``"bfloat16"``)."""
        import torch

        return getattr(torch, self.name)

    @property
    def torch_raw_word(self) -> "torch.dtype":
        """The torch integer dtype of one raw word (``torch.int16`` / ``torch.int32``)."""
        import torch

        return torch.int16 if self.raw_word is np.int16 else torch.int32


#: payload dtype name -> PayloadDtype; read-only
PAYLOAD_DTYPES: Mapping[str, PayloadDtype] = MappingProxyType({
    "bfloat16": PayloadDtype("bfloat16", np.int16, 2, kernel_code=0),
    "float16": PayloadDtype("float16", np.int16, 2, kernel_code=1),
    "float32": PayloadDtype("float32", np.int32, 4, kernel_code=2),
})


def payload_dtype(name: str) -> PayloadDtype:
    """The PayloadDtype called ``name``; ConfigError naming the known names otherwise."""
    try:
        return PAYLOAD_DTYPES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"payload dtype must be one of {sorted(PAYLOAD_DTYPES)}, "
                          f"got {name!r}") from None


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of payload dtype ``name``."""
    return payload_dtype(name).torch_dtype


def raw_dtype(name: str) -> type:
    """numpy dtype of one raw payload word for payload dtype ``name``."""
    return payload_dtype(name).raw_word


def torch_to_raw(tensor: "torch.Tensor", name: str) -> np.ndarray:
    """Zero-copy numpy raw-word view of a contiguous CPU tensor of payload dtype ``name``.

    tensor: [..., H] ``name``, cpu (copied first only when not contiguous).
    Returns [..., H] int16/int32 numpy, sharing the tensor's memory.
    """
    return tensor.contiguous().view(payload_dtype(name).torch_raw_word).numpy()


def raw_to_torch(raw: np.ndarray, name: str) -> "torch.Tensor":
    """Zero-copy torch view (payload dtype ``name``, cpu) of numpy raw words [..., H]."""
    import torch

    return torch.from_numpy(raw).view(payload_dtype(name).torch_dtype)


def raw_to_f32(raw: np.ndarray, name: str) -> np.ndarray:
    """fp32 copy of raw payload words: [..., H] int16/int32 -> [..., H] float32 numpy."""
    if name == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if name == "float16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32).copy()


def f32_to_raw(values: np.ndarray, name: str) -> np.ndarray:
    """Raw payload words of fp32 ``values`` rounded to payload dtype ``name`` (to nearest even,
    as the kernels' ``cvt.rn``): [..., H] float32 -> [..., H] int16/int32 numpy. NaN stays NaN."""
    values = np.ascontiguousarray(values, np.float32)
    if name == "bfloat16":
        bits = values.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        rounded = np.where(np.isnan(values), np.uint32(0x7FC0), rounded)
        return rounded.astype(np.uint16).view(np.int16)
    if name == "float16":
        return values.astype(np.float16).view(np.int16)
    return values.view(np.int32).copy()
