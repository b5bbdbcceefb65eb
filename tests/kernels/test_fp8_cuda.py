"""FP8 dispatch rows on the device (raw_kernels/common/fp8.cuh) against the numpy reference
(afd_cupy.wire.fp8), bit for bit: afd_dispatch_scatter and afd_dispatch_fused with FLAG_FP8
write every peer window exactly as the reference quantizer says (codes, scales, zero pad,
header with FLAG_FP8), and afd_fp8_dequant_rows decodes wire rows exactly as
``dequantize_wire_rows`` + the payload rounding. Fresh random rows per test, outputs prefilled
with NaN, groups of very different magnitudes, zero groups and rows, every E4M3 code."""
from __future__ import annotations

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.wire import fp8
from afd_cupy.wire.dtypes import f32_to_raw

from helpers.layouts import kernel_layout
from helpers.rng import node_rng

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.cuda

from test_kernels_cuda import (NUM_EXPERTS, Dispatch, assert_window_equal, put,  # noqa: E402
                               skewed_ids, status_of, sync, to_f32, to_raw)

FP8_DTYPES = ("bfloat16", "float16")
NAN_WORD = 0xFFFF  # a NaN in bf16 and in fp16


def spread_rows(rng, num_rows: int, hidden: int, dtype: str) -> np.ndarray:
    """Raw payload words [num_rows, hidden]: N(0, 1) per channel, each 128-channel group scaled
    by 2^u, u ~ U(-14, 10) (E4M3 subnormals after scaling, saturation-prone maxima), one zero
    group and, with more than 2 rows, one zero row."""
    x = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    groups = np.exp2(rng.uniform(-14, 10, (num_rows, hidden // 128, 1))).astype(np.float32)
    x = (x.reshape(num_rows, -1, 128) * groups).reshape(num_rows, hidden)
    if num_rows:
        x[0, :128] = 0.0
    if num_rows > 2:
        x[num_rows // 2] = 0.0
    return to_raw(x, dtype)


class FP8Dispatch(Dispatch):
    """Dispatch (test_kernels_cuda) with ``hdr_flags = FLAG_FP8``: the expected windows hold the
    reference's FP8 wire rows at the FP8 row stride and headers with FLAG_FP8."""

    fp8_rows = True

    def __init__(self, rng, **kw):
        super().__init__(rng, **kw)
        self.hidden_raw = spread_rows(rng, self.num_tokens, self.hidden, self.dtype)
        if self.num_tokens:
            self.hidden_dev[:self.num_tokens] = cp.asarray(self.hidden_raw)
        self.wire_rows = fp8.quantize_wire_rows(to_f32(self.hidden_raw, self.dtype))

    def sent_rows(self) -> np.ndarray:
        return self.wire_rows


# hidden sizes: one group; two; 37 groups (odd: uneven row parts); the decode shape 7168;
# 65 groups (three row parts)
FP8_CASES = [(1, 1, 128), (2, 7, 256), (3, 5, 4736), (2, 3, 7168), (4, 40, 256), (1, 2, 8320)]


@pytest.mark.parametrize("fused", [False, True], ids=["plan+scatter", "fused"])
@pytest.mark.parametrize("has_shared", [0, 1])
@pytest.mark.parametrize("num_ffn,num_tokens,hidden", FP8_CASES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_dispatch_writes_the_reference_wire_rows(request, dtype, num_ffn, num_tokens, hidden,
                                                     has_shared, fused):
    rng = node_rng(request)
    top_k = (2, 8, 1, 6)[(num_tokens + num_ffn) % 4]
    ids = skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
    d = FP8Dispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                    hidden=hidden, has_shared=has_shared, ids=ids)
    d.run(fused=fused)
    assert status_of(d.status.array).ok
    plan = d.reference()
    expected = d.expected.get()
    for j in range(num_ffn):
        non_empty = plan.routed_count(j) + d.shared_rows(j) > 0
        seq = int(d.seq_before[j]) + 1 if non_empty else 0
        assert expected[j] == seq
        got = d.windows[j].get()
        want = d.expected_window(j, plan, seq) if non_empty else d.prefill[j]
        assert_window_equal(got, want, d.layout, f"peer {j}")


def test_fp8_dispatch_spec_refuses_rows_it_cannot_quantize():
    with pytest.raises(ValueError, match="FLAG_FP8.*hidden_size % 128 == 0, got dtype_code=0, hidden_size=192"):
        kernels.dispatch_row_bytes(192, kernels.DTYPE_CODES["bfloat16"], wire.FLAG_FP8)
    with pytest.raises(ValueError, match="dtype_code=2"):
        kernels.dispatch_row_bytes(256, kernels.DTYPE_CODES["float32"], wire.FLAG_FP8)
    assert kernels.dispatch_row_bytes(7168, kernels.DTYPE_CODES["bfloat16"], wire.FLAG_FP8) == 7392
    assert kernels.dispatch_row_bytes(7168, kernels.DTYPE_CODES["bfloat16"], 0) == 14336


def every_code_rows(rng, num_rows: int, hidden: int) -> np.ndarray:
    """uint8 wire rows [num_rows, fp8_row_bytes(hidden)] whose codes are every finite E4M3 code
    (0x7f / 0xff, the NaNs, left out) in random order, and random positive scales (one zero)."""
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = rng.choice(finite, size=(num_rows, hidden))
    flat = codes.reshape(-1)
    flat[:min(flat.size, finite.size)] = finite[:flat.size]  # each code once where rows allow
    # scales up to 2^6: 448 * 64 stays finite in fp16; down to 2^-20: fp16 / bf16 subnormals
    scales = np.exp2(rng.uniform(-20, 6, (num_rows, hidden // 128))).astype(np.float32)
    scales[0, 0] = 0.0
    return fp8.pack_rows(codes, scales)


@pytest.mark.parametrize("num_routed,num_shared", [(1, 0), (13, 4), (300, 0), (0, 3)])
@pytest.mark.parametrize("hidden", [128, 7168])
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_dequant_rows_match_the_reference(request, dtype, hidden, num_routed, num_shared):
    rng = node_rng(request)
    layout = kernel_layout(num_regions=3, ring_depth=2, epr=4, hidden=hidden, dtype=dtype, top_k=2,
                           token_cap=max(num_routed, num_shared, 1) * 2, routed_cap=max(num_routed, 1),
                           has_shared=1, num_ffn=1)
    region, ring = 2, 1
    slot = layout.slot_index(region, ring)
    routed_rows = every_code_rows(rng, max(num_routed, 1), hidden)[:num_routed]
    shared_rows = fp8.quantize_wire_rows(to_f32(spread_rows(rng, max(num_shared, 1), hidden, dtype),
                                                dtype))[:num_shared]
    window = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    base = layout.slot_offset(region, ring)
    if num_routed:
        put(window, base + layout.field_offset("routed_x"), routed_rows)
    if num_shared:
        put(window, base + layout.field_offset("shared_x"), shared_rows)
    window_dev = cp.asarray(window)
    routed_out = cp.full((num_routed + 1, hidden), NAN_WORD, cp.uint16)  # one spare row stays NaN
    shared_out = cp.full((num_shared + 1, hidden), NAN_WORD, cp.uint16)
    kernels.fp8_dequant_rows_spec(
        dtype_code=kernels.DTYPE_CODES[dtype], window=window_dev.data.ptr,
        geo=layout.kernel_geometry(), slot=slot, hidden_size=hidden, num_routed=num_routed,
        num_shared=num_shared, routed_out=routed_out.data.ptr if num_routed else 0,
        shared_out=shared_out.data.ptr if num_shared else 0).launch()
    sync()
    for rows, out in ((routed_rows, routed_out), (shared_rows, shared_out)):
        got = out.get()
        want = f32_to_raw(fp8.dequantize_wire_rows(rows, hidden), dtype).view(np.uint16)
        np.testing.assert_array_equal(got[:len(rows)], want)
        assert (got[len(rows):] == NAN_WORD).all()
    assert (window_dev.get() == window).all()  # the receive reads the window only
