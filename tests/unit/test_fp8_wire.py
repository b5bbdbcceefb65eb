"""FP8 on the dispatch wire (afd_cupy.wire.fp8, docs/design/fp8.md): the numpy E4M3 quantizer
that is the kernels' reference, the wire row layout, the slot geometry and the config checks.
CPU only."""
import numpy as np
import pytest
import torch

from afd_cupy import wire
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.errors import ConfigError, WireError
from afd_cupy.wire import fp8
from afd_cupy.wire.dtypes import f32_to_raw, raw_to_f32



def _rows(seed, num_rows, hidden, scale_spread=4.0):
    """fp32 [num_rows, hidden] rows with per-group magnitudes spread over 2^+-scale_spread."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    groups = np.exp2(rng.uniform(-scale_spread, scale_spread, (num_rows, hidden // 128, 1)))
    return (x.reshape(num_rows, -1, 128) * groups).reshape(num_rows, hidden).astype(np.float32)


def test_e4m3_encode_matches_torch_float8_e4m3fn_on_every_code_and_between():
    values = fp8.E4M3_TABLE[np.r_[0:127, 128:255]]  # every finite code
    mids = (values[:-1].astype(np.float64) + values[1:]) / 2  # ties: round to even
    rng = np.random.default_rng(0)
    random = rng.standard_normal(20000).astype(np.float32) * np.exp2(rng.uniform(-12, 9, 20000)).astype(np.float32)
    x = np.concatenate([values, mids[np.isfinite(mids)].astype(np.float32), random])
    x = x[np.abs(x) <= 448]  # torch's cast does not saturate
    ours = fp8.e4m3_encode(x)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(ours, theirs)
    assert np.array_equal(fp8.e4m3_decode(ours), torch.from_numpy(theirs).view(torch.float8_e4m3fn).float().numpy())


def test_e4m3_encode_saturates_and_keeps_signs():
    x = np.array([448.0, 449.0, 463.0, 464.0, 1e30, -500.0, -0.0, 0.0, 2.0**-10, -(2.0**-9)], np.float32)
    codes = fp8.e4m3_encode(x)
    assert codes.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x80, 0x00, 0x00, 0x81]
    assert fp8.e4m3_decode(codes)[:6].tolist() == [448.0] * 5 + [-448.0]


@pytest.mark.parametrize("hidden", [128, 384, 7168])
def test_quantize_rows_round_trip_within_half_an_ulp(hidden):
    x = _rows(hidden, 16, hidden)
    codes, scales = fp8.quantize_rows(x)
    assert codes.dtype == np.uint8 and codes.shape == (16, hidden)
    assert scales.dtype == np.float32 and scales.shape == (16, hidden // 128)
    groups = x.reshape(16, -1, 128)
    amax = np.abs(groups).max(axis=2)
    assert np.array_equal(scales, (amax / np.float32(448)).astype(np.float32))
    assert np.abs(fp8.e4m3_decode(codes)).max() <= 448
    back = fp8.dequantize_rows(codes, scales).reshape(16, -1, 128)
    # half an E4M3 ulp of the value (2^-4 relative) or, in the subnormal range, 2^-10 of the
    # group's scale; plus the fp32 roundings of x * inv and value * scale
    bound = np.maximum(np.abs(groups) * 2.0**-4, scales[:, :, None] * 2.0**-10) * (1 + 2**-20) + 1e-30
    assert (np.abs(back - groups) <= bound).all()
    assert fp8.calc_diff(back, groups) < 7e-4  # DeepEP's bar for an FP8 dispatch


def test_zero_rows_and_zero_groups_decode_to_zeros():
    x = _rows(1, 4, 512)
    x[0] = 0.0
    x[1, 128:256] = 0.0
    codes, scales = fp8.quantize_rows(x)
    assert scales[0].tolist() == [0.0] * 4 and scales[1, 1] == 0.0
    assert not codes[0].any() and not codes[1, 128:256].any()
    back = fp8.dequantize_rows(codes, scales)
    assert np.isfinite(back).all()
    assert not back[0].any() and not back[1, 128:256].any()
    assert np.abs(back[1, :128] - x[1, :128]).max() > 0  # the other groups are quantized


def test_largest_value_of_a_group_maps_to_448():
    x = _rows(2, 8, 256)
    codes, scales = fp8.quantize_rows(x)
    values = np.abs(fp8.e4m3_decode(codes)).reshape(8, 2, 128)
    assert (values.max(axis=2) == 448).all()


def test_wire_row_layout_codes_then_scales_then_zero_pad():
    hidden = 256
    x = _rows(3, 5, hidden)
    codes, scales = fp8.quantize_rows(x)
    rows = fp8.quantize_wire_rows(x)
    assert rows.shape == (5, fp8.fp8_row_bytes(hidden)) == (5, 272)  # 256 + 8 -> 16-B multiple
    assert np.array_equal(rows[:, :hidden], codes)
    assert np.array_equal(rows[:, hidden:hidden + 8].copy().view(np.float32), scales)
    assert not rows[:, hidden + 8:].any()
    again = fp8.unpack_rows(rows, hidden)
    assert np.array_equal(again[0], codes) and np.array_equal(again[1], scales)


def test_row_bytes_of_the_decode_shape():
    # hidden 7168: 7168 codes + 56 fp32 scales = 7392 B, already a multiple of 16
    assert fp8.fp8_row_bytes(7168) == 7168 + 56 * 4 == 7392
    assert fp8.fp8_row_bytes(128) == 144  # 132 padded to 16


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_f32_to_raw_rounds_like_torch(name):
    x = _rows(4, 3, 128).ravel() * 1e3
    ours = raw_to_f32(f32_to_raw(x, name), name)
    theirs = torch.from_numpy(x).to(getattr(torch, name)).float().numpy()
    assert np.array_equal(ours, theirs)


def _configs(dispatch_dtype="fp8_e4m3", dtype="bfloat16", hidden=256, wire_mode="pair"):
    model = ModelConfig(hidden_size=hidden, num_experts=8, top_k=2, moe_intermediate_size=64,
                        num_shared_experts=1, dtype=dtype, max_num_batched_tokens=32)
    return model, TopologyConfig(2, 2), ConnectorConfig(wire_mode=wire_mode, dispatch_dtype=dispatch_dtype)


def test_config_rejects_unknown_dispatch_dtype_and_dedup():
    with pytest.raises(ConfigError, match="dispatch_dtype must be one of .* got 'fp8'"):
        ConnectorConfig(dispatch_dtype="fp8")
    with pytest.raises(ConfigError, match="dispatch_dtype='fp8_e4m3' is implemented for wire_mode='pair' "
                                          "only, got wire_mode='dedup'"):
        ConnectorConfig(wire_mode="dedup", dispatch_dtype="fp8_e4m3")
    assert ConnectorConfig.from_mapping({"dispatch_dtype": "fp8_e4m3"}).dispatch_dtype == "fp8_e4m3"


@pytest.mark.parametrize("dtype,hidden,match", [
    ("float32", 256, "needs a payload dtype in .* got ModelConfig.dtype='float32'"),
    ("bfloat16", 192, "needs hidden_size % 128 == 0 .* got hidden_size=192"),
])
def test_layout_rejects_fp8_with_a_model_it_cannot_run(dtype, hidden, match):
    with pytest.raises(ConfigError, match=match):
        wire.WindowLayout.from_configs(*_configs(dtype=dtype, hidden=hidden))


def test_fp8_layout_geometry_and_message_bytes():
    payload = wire.WindowLayout.from_configs(*_configs(dispatch_dtype="payload"))
    layout = wire.WindowLayout.from_configs(*_configs())
    assert layout.is_fp8_dispatch and not payload.is_fp8_dispatch
    assert layout.dispatch_row_bytes == fp8.fp8_row_bytes(256) and payload.dispatch_row_bytes == 512
    # a slot holds replies (payload rows) too: its geometry is the payload layout's
    assert layout.slot_bytes == payload.slot_bytes and layout.window_bytes == payload.window_bytes
    kw = dict(routed_tokens=10, shared_tokens=3)
    assert (payload.message_bytes(reply=False, **kw) - layout.message_bytes(reply=False, **kw)
            == 13 * (512 - fp8.fp8_row_bytes(256)))
    assert layout.message_bytes(reply=True, **kw) == payload.message_bytes(reply=True, **kw)
    # the FFN decodes into staging rows of the payload dtype, one set per slot
    assert payload.ffn_staging_bytes == 0
    assert layout.ffn_staging_bytes == layout.num_slots * (
        wire.align_up(layout.routed_cap * 512) + wire.align_up(layout.shared_cap * 512))
    assert layout.as_dict()["dispatch_dtype"] == "fp8_e4m3"  # exchanged with the geometry
    with pytest.raises(WireError, match="dispatch_dtype must be one of"):
        wire.WindowLayout(**{**layout.as_dict(), "dispatch_dtype": "e5m2"})


def test_dispatch_header_flag_and_the_receivers_check():
    fp8_layout = wire.WindowLayout.from_configs(*_configs())
    payload_layout = wire.WindowLayout.from_configs(*_configs(dispatch_dtype="payload"))
    header = wire.dispatch_header(seq=3, src_rank=1, layer_idx=2, stage_idx=0, num_tokens=4,
                                  shared_tokens=2, top_k=2, expert_counts=(1, 2, 3, 2), fp8=True)
    assert header.is_fp8 and header.flags == wire.FLAG_FP8
    words = wire.encode_header(header, 4)
    assert wire.decode_header(words, 4, fp8_layout).is_fp8  # the structural checks pass
    wire.check_dispatch_rows(header, fp8_layout)
    with pytest.raises(WireError, match=r"flags 0x10 mark dispatch_dtype='fp8_e4m3' rows; this FFN "
                                        r"rank reads dispatch_dtype='payload'"):
        wire.check_dispatch_rows(header, payload_layout)
    plain = wire.dispatch_header(seq=3, src_rank=1, layer_idx=2, stage_idx=0, num_tokens=4,
                                 shared_tokens=2, top_k=2, expert_counts=(1, 2, 3, 2))
    assert wire.dispatch_rows_fault(plain.flags, fp8_layout) == (wire.HDR_FLAGS, wire.FLAG_FP8, 0)
    with pytest.raises(WireError, match="mark dispatch_dtype='payload' rows; this FFN rank reads "
                                        "dispatch_dtype='fp8_e4m3'"):
        wire.check_dispatch_rows(plain, fp8_layout)
    shutdown = wire.shutdown_header(src_rank=1, top_k=2, expert_per_rank=4)
    wire.check_dispatch_rows(shutdown, fp8_layout)  # no rows: either receiver takes it
    # replies carry the payload dtype: the flag is not echoed
    assert not wire.reply_header(header, seq=1, src_rank=0).is_fp8
    with pytest.raises(WireError, match="fp8=True"):
        wire.dispatch_header(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=1,
                             shared_tokens=0, top_k=2, expert_counts=(1, 1, 0, 0),
                             wire_mode="dedup", num_rows=1, fp8=True)
