"""FP8 on the dispatch wire: the row format of ``ConnectorConfig.dispatch_dtype="fp8_e4m3"``
and its numpy reference quantizer (docs/design/fp8.md, docs/design/wire-format.md). Part of
:mod:`afd_cupy.wire`; the device twin is ``raw_kernels/common/fp8.cuh``.

A dispatched row in FP8 (``FLAG_FP8`` in the header) is ``fp8_row_bytes(H)`` bytes::

    | codes: uint8 [H] (E4M3) | scales: fp32 [H / 128] | zero pad to 16 B |

Group ``g`` holds channels ``[128 g, 128 g + 128)``; its scale is ``amax / 448`` (fp32), its
codes are E4M3 of ``x * (448 / amax)`` (one fp32 multiply, then one rounding: to nearest even,
saturated at +-448, as the device's ``cvt.rn.satfinite.e4m3x2.f32``). A group of zeros gets
scale 0 and codes 0 and decodes to zeros. A row decodes to ``code_value * scale`` in fp32,
rounded once to the payload dtype. Replies stay in the payload dtype.

Every function here is numpy only (no torch), bit-exact with the device's helpers: the
quantizer, the decoder and the bf16 / fp16 roundings are IEEE operations in the same order.
NOTE: rows must be finite: an inf makes its group's scale inf and its codes NaN.
"""
from __future__ import annotations

import numpy as np

from afd_cupy.errors import ConfigError

#: ``ConnectorConfig.dispatch_dtype`` values: the payload dtype itself, or E4M3 codes with one
#: fp32 scale per FP8_GROUP channels
DISPATCH_DTYPES = ("payload", "fp8_e4m3")
#: channels per fp32 scale of an FP8 row
FP8_GROUP = 128
#: largest finite E4M3 (fn) value: amax maps to it
E4M3_MAX = 448.0
#: payload dtypes an FP8 dispatch accepts (the rows are quantized from them, and the FFN
#: dequantizes back to them)
FP8_PAYLOADS = ("bfloat16", "float16")
_ROW_ALIGN = 16


def fp8_row_bytes(hidden_size: int) -> int:
    """Bytes of one FP8 wire row: ``hidden_size`` codes + ``hidden_size / 128`` fp32 scales,
    padded to 16 B (hidden 7168: 7168 + 224 = 7392 B)."""
    raw = hidden_size + 4 * (hidden_size // FP8_GROUP)
    return -(-raw // _ROW_ALIGN) * _ROW_ALIGN


def check_dispatch_dtype(dispatch_dtype: str, *, payload_dtype: str, hidden_size: int,
                         wire_mode: str) -> None:
    """ConfigError naming the values when ``dispatch_dtype`` cannot run with this model and
    wire mode: FP8 needs a bf16 / fp16 payload, ``hidden_size % 128 == 0`` and
    ``wire_mode="pair"`` (the dedup mode's FP8 rows are not implemented)."""
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ConfigError(f"ConnectorConfig.dispatch_dtype must be one of {DISPATCH_DTYPES}, "
                          f"got {dispatch_dtype!r}")
    if dispatch_dtype == "payload":
        return
    if payload_dtype not in FP8_PAYLOADS:
        raise ConfigError(f"dispatch_dtype={dispatch_dtype!r} needs a payload dtype in "
                          f"{FP8_PAYLOADS}, got ModelConfig.dtype={payload_dtype!r}")
    if hidden_size % FP8_GROUP:
        raise ConfigError(f"dispatch_dtype={dispatch_dtype!r} needs hidden_size % {FP8_GROUP} == 0 "
                          f"(one scale per {FP8_GROUP} channels), got hidden_size={hidden_size}")
    if wire_mode != "pair":
        raise ConfigError(f"dispatch_dtype={dispatch_dtype!r} is implemented for wire_mode='pair' "
                          f"only, got wire_mode={wire_mode!r}")


# --- E4M3 --------------------------------------------------------------------------------
def _e4m3_values() -> np.ndarray:
    """fp32 [128]: the value of each non-negative E4M3 (fn) code 0..127 (127 is NaN)."""
    codes = np.arange(128)
    exponent, mantissa = codes >> 3, codes & 7
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    subnormal = np.ldexp(mantissa / 8.0, -6)
    values = np.where(exponent == 0, subnormal, normal).astype(np.float32)
    values[127] = np.nan
    return values


_E4M3_POSITIVE = _e4m3_values()
#: fp32 [256]: the value of every E4M3 code (bit 7: sign; 0x7f and 0xff are NaN)
E4M3_TABLE = np.concatenate([_E4M3_POSITIVE, -_E4M3_POSITIVE]).astype(np.float32)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """uint8 E4M3 codes of fp32 ``x`` (any shape): round to nearest even, subnormals kept,
    saturated at +-448 (``cvt.rn.satfinite.e4m3x2.f32``); NaN -> 0x7f (with its sign bit)."""
    x = np.asarray(x, np.float32)
    sign = (x.view(np.uint32) >> 31).astype(np.uint8) << 7
    mag = np.minimum(np.abs(x), np.float32(E4M3_MAX))  # NaN stays NaN
    # quantum of the binade: 2^(e - 3) for a normal value 2^e * 1.m, 2^-9 below 2^-6
    _, exp2 = np.frexp(mag)
    quantum = np.ldexp(np.float32(1.0), np.maximum(exp2 - 1, -6) - 3).astype(np.float32)
    rounded = np.rint(mag / quantum) * quantum  # exact: scaling by powers of two; rint is RNE
    code = np.searchsorted(_E4M3_POSITIVE[:127], np.nan_to_num(rounded, nan=0.0)).astype(np.uint8)
    code = np.where(np.isnan(mag), np.uint8(0x7F), code).astype(np.uint8)
    return code | sign


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """fp32 values of uint8 E4M3 codes (any shape)."""
    return E4M3_TABLE[np.asarray(codes, np.uint8)]


# --- rows ----------------------------------------------------------------------------------
def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: fp32 [N, H] (H % 128 == 0) -> (codes uint8 [N, H], scales fp32 [N, H / 128]).

    Per 128-channel group: ``scale = amax / 448``, ``codes = e4m3(x * (448 / amax))``; a group
    whose amax is 0 gets scale 0 and codes 0."""
    x = np.asarray(x, np.float32)
    num_rows, hidden = x.shape
    groups = x.reshape(num_rows, hidden // FP8_GROUP, FP8_GROUP)
    amax = np.abs(groups).max(axis=2)
    positive = amax > 0
    with np.errstate(divide="ignore"):
        inv = np.where(positive, np.float32(E4M3_MAX) / np.where(positive, amax, 1), 0)
    inv = inv.astype(np.float32)
    scales = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    codes = e4m3_encode(groups * inv[:, :, None])
    return codes.reshape(num_rows, hidden), scales


def dequantize_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(codes uint8 [N, H], scales fp32 [N, H / 128]) -> fp32 [N, H]: ``value * scale``, one
    fp32 multiply per element (round it to the payload dtype with ``dtypes.f32_to_raw``)."""
    codes = np.asarray(codes, np.uint8)
    num_rows, hidden = codes.shape
    values = e4m3_decode(codes).reshape(num_rows, hidden // FP8_GROUP, FP8_GROUP)
    return (values * np.asarray(scales, np.float32)[:, :, None]).reshape(num_rows, hidden)


def pack_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The wire rows: uint8 [N, fp8_row_bytes(H)] = codes, then the scales' bytes, then zeros."""
    num_rows, hidden = codes.shape
    rows = np.zeros((num_rows, fp8_row_bytes(hidden)), np.uint8)
    rows[:, :hidden] = codes
    rows[:, hidden:hidden + 4 * scales.shape[1]] = np.ascontiguousarray(scales, np.float32).view(np.uint8)
    return rows


def unpack_rows(rows: np.ndarray, hidden_size: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, >= fp8_row_bytes(H)] wire rows -> (codes uint8 [N, H], scales fp32 [N, H / 128])."""
    rows = np.asarray(rows, np.uint8)
    num_groups = hidden_size // FP8_GROUP
    codes = rows[:, :hidden_size].copy()
    scales = np.ascontiguousarray(rows[:, hidden_size:hidden_size + 4 * num_groups]).view(np.float32)
    return codes, scales.reshape(rows.shape[0], num_groups)


def quantize_wire_rows(x: np.ndarray) -> np.ndarray:
    """fp32 [N, H] -> uint8 [N, fp8_row_bytes(H)]: what an FP8 dispatch writes per row."""
    return pack_rows(*quantize_rows(x))


def dequantize_wire_rows(rows: np.ndarray, hidden_size: int) -> np.ndarray:
    """uint8 [N, >= fp8_row_bytes(H)] wire rows -> fp32 [N, H] (before the payload rounding)."""
    return dequantize_rows(*unpack_rows(rows, hidden_size))


def calc_diff(x: np.ndarray, y: np.ndarray) -> float:
    """DeepEP's similarity measure ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in fp64 (0 for equal
    arrays; about half the squared relative error for small differences)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    denom = float((x * x + y * y).sum())
    return 0.0 if denom == 0.0 else 1.0 - 2.0 * float((x * y).sum()) / denom
