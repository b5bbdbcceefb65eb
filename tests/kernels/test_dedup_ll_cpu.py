"""``ConnectorConfig(dedup_dispatch="ll")`` without a GPU: the knob's validation, the kernel
source's mirror constants and C signature (afd_dedup_dispatch_ll takes exactly
afd_dedup_dispatch_fused's parameters, so one packed launch serves either), the spec's
argument order, grid and shared memory, and the cuda backend's choice of kernel.
The kernel itself runs in tests/kernels/test_kernels_cuda_dedup_ll.py and tests/integration/test_e2e_dedup_ll.py."""
from __future__ import annotations

import re
import types

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.config import RANK_LOCAL_FIELDS, ConnectorConfig
from afd_cupy.errors import ConfigError
from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.specs import dedup_attn_ll


def _source(name: str) -> str:
    return (kernels.KERNEL_DIR / name).read_text()


def _parameters(filename: str, kernel: str) -> list[str]:
    """The C parameter names of ``kernel`` in ``filename`` (comments stripped)."""
    text = re.sub(r"//[^\n]*", "", _source(filename))
    body = re.search(kernel + r"\((.*?)\)\s*\{", text, re.DOTALL).group(1)
    return [re.findall(r"\w+", part)[-1] for part in body.split(",")]


def test_knob_defaults_to_plan_validates_and_is_rank_local():
    assert ConnectorConfig().dedup_dispatch == "plan"
    assert ConnectorConfig(dedup_dispatch="ll").dedup_dispatch == "ll"
    assert ConnectorConfig.from_mapping({"dedup_dispatch": "ll"}).dedup_dispatch == "ll"
    with pytest.raises(ConfigError, match=r"dedup_dispatch must be one of \('plan', 'll'\), got 'fast'"):
        ConnectorConfig(dedup_dispatch="fast")
    assert "dedup_dispatch" in RANK_LOCAL_FIELDS  # the same bytes either way


def test_ll_kernel_mirrors_and_includes():
    text = _source("attention/dedup_attn_ll.cu")
    assert int(re.search(r"constexpr int LL_MAX_FFN_RANKS = (\d+);", text).group(1)) == \
        dedup_attn_ll.LL_MAX_FFN_RANKS
    assert set(re.findall(r'#\s*include\s*"([^"]+)"', text)) <= {
        "common/wire.cuh", "common/payload.cuh", "common/block.cuh", "common/publish.cuh",
        "attention/plan_block.cuh", "attention/dedup_attn.cuh"}
    assert loader.FILE_KERNELS["attention/dedup_attn_ll.cu"] == (("afd_dedup_dispatch_ll", True),)


def test_ll_kernel_takes_the_fused_kernels_parameters():
    fused = _parameters("attention/dedup_attn_fused.cu", "afd_dedup_dispatch_fused")
    assert _parameters("attention/dedup_attn_ll.cu", "afd_dedup_dispatch_ll") == fused
    assert fused[0] == "hidden" and fused[-1] == "status" and len(fused) == 33


class _FakeArray:
    """Stands in for a CuPy array (the array check is replaced)."""


@pytest.fixture
def fake_specs(monkeypatch):
    monkeypatch.setattr(loader, "get_kernel", lambda filename, name, **kw: (filename, name))
    monkeypatch.setattr(checks, "device_array", lambda name, arr, dtype, min_size: _FakeArray())


_LAYOUT = wire.WindowLayout(num_regions=3, ring_depth=2, expert_per_rank=4, hidden_size=64,
                            itemsize=2, top_k=8, token_cap=8, routed_cap=64, shared_cap=8,
                            wire_mode="dedup")


def _spec_args(num_tokens=8, num_ffn=2, **kw):
    arr = _FakeArray()
    args = dict(dtype_code=0, hidden=0x2000, num_tokens=num_tokens, hidden_size=64, topk_ids=arr,
                topk_weights=arr, top_k=8, expert_per_rank=4, num_ffn_ranks=num_ffn, routed_cap=64,
                has_shared=1, expert_counts=arr, expert_start=arr, rank_offsets=arr, verdict=arr,
                skipped=arr, row_map=arr, shared_rank=arr, num_rows=arr, shared_rows=arr,
                peer_windows=arr, geo=_LAYOUT.kernel_geometry(), ring=1, src_rank=0, layer_idx=3,
                stage_idx=1, seq_counters=arr, expected=arr, expected_counts=arr, done_counter=arr,
                status=0x1000, staging=0x9000)
    args.update(kw)
    return args


def test_ll_spec_matches_the_fused_spec_but_kernel_grid_and_shared(fake_specs):
    ll = kernels.dedup_dispatch_ll_spec(**_spec_args(), max_tokens=8)
    fused = kernels.dedup_dispatch_fused_spec(**_spec_args(), max_tokens=8)
    assert ll.names == fused.names == tuple(_parameters("attention/dedup_attn_ll.cu", "afd_dedup_dispatch_ll"))
    def shown(args):  # every array check returns a fresh stand-in
        return ["array" if isinstance(a, _FakeArray) else repr(a) for a in args]

    assert shown(ll.args) == shown(fused.args)
    assert ll.kernel == ("attention/dedup_attn_ll.cu", "afd_dedup_dispatch_ll")
    assert ll.grid == fused.grid + 1 == kernels.dedup_ll_grid(8, 2, 128)
    assert ll.shared_mem == dedup_attn_ll.dedup_ll_shared_bytes(8, 8, 8, 2)
    # ids, staging rows and weights per partial: 4 * (3 * 64 + 2 * 8 + 2 * 8) + 16 * 8 + 2 * 8 * 2
    assert ll.shared_mem == 4 * (192 + 16 + 16) + 128 + 32


def test_ll_grid_and_fit():
    assert kernels.dedup_ll_grid(0, 4, 14336) == 1  # block 0 alone: headers (always_send)
    assert kernels.dedup_ll_grid(1, 1, 14336) == 2  # one 14 KiB row: 4 parts, one copy block
    assert kernels.dedup_ll_grid(128, 1, 14336) == 1 + 64
    assert kernels.dedup_ll_grid(10**5, 8, 14336) == 1 + kernels.MAX_BLOCKS
    assert kernels.ll_dedup_dispatch_fits(128, 8, 256, 1)  # the decode shape of issue 33
    assert kernels.ll_dedup_dispatch_fits(256, 8, 256, 8)
    assert not kernels.ll_dedup_dispatch_fits(128, 8, 256, 33)  # past one rank mask word
    assert not kernels.ll_dedup_dispatch_fits(8192, 8, 8, 1)  # T*K = 2**16: 16-bit counts
    assert not kernels.ll_dedup_dispatch_fits(4096, 8, 256, 1)  # shared memory


def test_ll_spec_refuses_what_does_not_fit(fake_specs):
    with pytest.raises(ValueError, match=r"33 FFN ranks .*use dedup_dispatch='plan'"):
        kernels.dedup_dispatch_ll_spec(**_spec_args(num_ffn=33))
    with pytest.raises(ValueError, match="max_tokens=4 < num_tokens=8"):
        kernels.dedup_dispatch_ll_spec(**_spec_args(), max_tokens=4)


@pytest.mark.parametrize("ll", [False, True], ids=["fused", "ll"])
def test_backend_packs_the_ll_kernel_as_its_one_kernel_dispatch(fake_specs, monkeypatch, ll):
    from afd_cupy.backends import cuda_attention

    monkeypatch.setattr(kernels, "PackedLaunch", lambda spec: spec)
    side = cuda_attention.CudaAttentionPath.__new__(cuda_attention.CudaAttentionPath)
    side.cp, side.layout, side.is_dedup = np, _LAYOUT, True
    side.fused_dispatch, side.ll_dispatch = True, ll
    side.ctx = types.SimpleNamespace(num_ffn_ranks=2, has_shared=True, always_send=False, role_rank=0)
    side.rank = types.SimpleNamespace(  # the shared CudaRank's fields the launches read
        geometry=_LAYOUT.kernel_geometry(), own_window=0x3000, dtype_code=0, timeout_ns=10**9,
        link=types.SimpleNamespace(staging_base=0), status=types.SimpleNamespace(ptr=0x1000),
        last_seen=_FakeArray())
    scratch = types.SimpleNamespace(local_rank=np.zeros(64, np.int32), **{
        name: _FakeArray() for name in ("chunk_hist", "pos", "expert_counts", "expert_start",
                                        "rank_offsets", "verdict", "plan_done", "scatter_done",
                                        "skipped")})
    side.scratch = [scratch] * 2
    side.dedup_rows = [types.SimpleNamespace(**{
        name: _FakeArray() for name in ("row_map", "shared_rank", "num_rows", "shared_rows",
                                        "rows_hist", "rows_local", "rows_done")})] * 2
    side.expected = side.expected_counts = side.reply_flags = side.combine_done = [_FakeArray()] * 2
    side.seq_counters, side.peer_windows = [_FakeArray()] * 2, _FakeArray()
    side.routing = types.SimpleNamespace(buffers=[(_FakeArray(), _FakeArray())] * 2)
    launches = side._attention_launches(1)
    assert sorted(launches) == ["combine", "fused", "wait"]
    want = (("attention/dedup_attn_ll.cu", "afd_dedup_dispatch_ll") if ll
            else ("attention/dedup_attn_fused.cu", "afd_dedup_dispatch_fused"))
    assert launches["fused"].kernel == want
    assert launches["combine"].kernel == ("attention/dedup_attn.cu", "afd_dedup_combine")  # unchanged


def test_bench_step_graph_selects_and_compares_the_dedup_dispatch():
    import sys

    from helpers.paths import TOOLS_DIR

    sys.path.insert(0, str(TOOLS_DIR))
    import bench_step_graph as tool

    assert tool.connector_config(tool.parse_args([])).dedup_dispatch == "plan"
    ll = tool.parse_args(["--wire-mode", "dedup", "--dedup-dispatch", "ll"])
    assert tool.connector_config(ll).dedup_dispatch == "ll"
    both = tool.parse_args(["--wire-mode", "dedup", "--dedup-dispatch", "both"])
    assert both.dedup_dispatch == "both" and tool.connector_config(both).dedup_dispatch == "plan"
    with pytest.raises(SystemExit):
        tool.parse_args(["--dedup-dispatch", "ll"])  # pair mode has no dedup dispatch

    def report(layer_us, dispatch_us):
        phases = {"dispatch (plan + scatter)": {"median_us": dispatch_us}, "combine": {"median_us": None}}
        return {"rows": [{"tokens": 128, "layers": 1, "stages": 1, "graph_layer_median_us": layer_us}],
                "traces": [{"label": "T=128 L=1 graph", "phases": phases}]}

    text = tool.ab_table(report(80.0, 25.6), report(60.0, 6.4))
    assert "T=128 L=1 S=1 graph per layer" in text and "0.75" in text
    line = next(row for row in text.splitlines() if "dispatch (plan + scatter)" in row)
    assert "25.6" in line and "6.4" in line and "0.25" in line
    assert "combine" in text  # a phase without a median shows as "-"
