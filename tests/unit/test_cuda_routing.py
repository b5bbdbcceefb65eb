"""The cuda Attention path's routing copy (backends/cuda_routing.py) on the CPU: what its
afd_own_routing launch is given for each routing dtype (the kernel itself is checked against
numpy in tests/kernels/test_kernels_cuda.py::test_own_routing_matches_reference)."""
import types

import numpy as np
import pytest
import torch

from afd_cupy import kernels
from afd_cupy.backends import cuda_routing


class _Buffer:
    """A device buffer as the spec builder and launch read it: ``data.ptr`` and ``size``."""

    def __init__(self, ptr, size):
        self.data, self.size = types.SimpleNamespace(ptr=ptr), size


class _Launch:
    def __init__(self, spec):
        self.spec, self.values, self.launched = spec, {}, []

    def set(self, name, value):
        self.values[name] = value

    def launch(self, stream, grid):
        self.launched.append((stream, grid, dict(self.values)))


@pytest.fixture
def routing(monkeypatch):
    made = {"ptr": 0x1000}

    def zeros(size, dtype):
        made["ptr"] += 0x1000
        return _Buffer(made["ptr"], size)

    specs = []
    monkeypatch.setattr(kernels, "own_routing_spec", lambda **kw: specs.append(kw) or kw)
    monkeypatch.setattr(kernels, "PackedLaunch", _Launch)
    fake_cp = types.SimpleNamespace(zeros=zeros, int32=np.int32, float32=np.float32)
    owned = cuda_routing.OwnedRouting(fake_cp, num_rings=2, max_partials=64, num_experts=12)
    return owned, specs


@pytest.mark.parametrize("ids_dtype,weights_dtype,want_int64,want_code", [
    (torch.int32, torch.float32, 0, 2), (torch.int64, torch.bfloat16, 1, 0),
    (torch.int16, torch.float16, 1, 1), (torch.uint8, torch.float64, 1, 2)])
def test_sources_convert_only_what_the_kernel_cannot_read(ids_dtype, weights_dtype, want_int64, want_code):
    ids = torch.arange(12, dtype=torch.int64).reshape(3, 4).to(ids_dtype)
    weights = torch.rand(4, 3, dtype=torch.float32).to(weights_dtype).t()  # not contiguous
    got_ids, got_weights, code = cuda_routing.routing_sources(ids, weights)
    assert int(got_ids.dtype == torch.int64) == want_int64 and code == want_code
    assert got_ids.is_contiguous() and got_weights.is_contiguous()
    assert torch.equal(got_ids.long(), ids.long())
    assert torch.equal(got_weights.float(), weights.to(got_weights.dtype).float())
    if ids_dtype in (torch.int32, torch.int64):
        assert got_ids.data_ptr() == ids.data_ptr()  # read as it is: no copy


def test_launch_masks_int64_always_and_int32_on_request(routing):
    owned, specs = routing
    ids32, ids64 = torch.zeros(5, 8, dtype=torch.int32), torch.zeros(5, 8, dtype=torch.int64)
    weights = torch.zeros(5, 8)
    owned.launch(1, 77, ids32, weights, 2, 40, mask=False)
    owned.launch(1, 77, ids64, weights, 2, 40, mask=False)
    owned.launch(1, 77, ids32, weights, 2, 40, mask=True)
    owned.launch(0, 78, ids32, weights, 0, 3000, mask=False)  # another ring and weights dtype
    assert len(specs) == 2  # one packed launch per (ring, weights dtype), built once
    assert specs[0]["weights_dtype_code"] == 2 and specs[1]["weights_dtype_code"] == 0
    assert specs[0]["ids_out"] is owned.buffers[1][0] and specs[0]["weights_out"] is owned.buffers[1][1]
    assert specs[0]["num_experts"] == 12 and specs[0]["num_partials"] == 64
    launched = owned._launches[(1, 2)].launched
    assert [(v["ids_int64"], v["mask"]) for _, _, v in launched] == [(0, 0), (1, 1), (0, 1)]
    assert all(stream == 77 and grid == kernels.own_routing_grid(40) and v["num_partials"] == 40
               for stream, grid, v in launched)
    assert launched[0][2]["ids"] == ids32.data_ptr() and launched[1][2]["ids"] == ids64.data_ptr()
    (stream, grid, values), = owned._launches[(0, 0)].launched
    assert (stream, grid, values["num_partials"]) == (78, kernels.own_routing_grid(3000), 3000)
    assert kernels.own_routing_grid(0) == 1 and kernels.own_routing_grid(256 * 5000) == kernels.MAX_BLOCKS
