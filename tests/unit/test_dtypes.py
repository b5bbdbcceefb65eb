"""afd_cupy.wire.dtypes: the payload dtype table against torch, numpy and the wire.cuh mirror, and
the host conversions on random values."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from afd_cupy.errors import ConfigError
from afd_cupy.wire.dtypes import (PAYLOAD_DTYPES, payload_dtype, raw_dtype, raw_to_f32,
                                  raw_to_torch, torch_dtype, torch_to_raw)

from helpers.paths import RAW_KERNELS_DIR

WIRE_CUH = RAW_KERNELS_DIR / "common" / "wire.cuh"
CUH_NAMES = {"bfloat16": "DT_BF16", "float16": "DT_F16", "float32": "DT_F32"}


def test_kernel_codes_match_wire_cuh():
    text = WIRE_CUH.read_text()
    parsed = {name: int(code) for name, code in re.findall(r"constexpr\s+int\s+(DT_\w+)\s*=\s*(\d+)\s*;", text)}
    assert {name: dtype.kernel_code for name, dtype in PAYLOAD_DTYPES.items()} == \
        {name: parsed[cuh_name] for name, cuh_name in CUH_NAMES.items()}


@pytest.mark.parametrize("name", sorted(PAYLOAD_DTYPES))
def test_entry_agrees_with_torch_and_numpy(name):
    dtype = payload_dtype(name)
    assert dtype.name == name and torch_dtype(name) is getattr(torch, name)
    assert dtype.itemsize == np.dtype(dtype.raw_word).itemsize == dtype.torch_dtype.itemsize
    assert raw_dtype(name) is dtype.raw_word


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"one of \['bfloat16', 'float16', 'float32'\], got 'int8'"):
        payload_dtype("int8")


@pytest.mark.parametrize("name", sorted(PAYLOAD_DTYPES))
def test_raw_round_trip_on_random_values(name):
    values = torch.randn(5, 24, generator=torch.Generator().manual_seed(3)).to(torch_dtype(name))
    raw = torch_to_raw(values, name)
    assert raw.dtype == raw_dtype(name) and raw.shape == (5, 24)
    assert torch.equal(raw_to_torch(raw, name), values)
    np.testing.assert_array_equal(raw_to_f32(raw, name), values.float().numpy())
