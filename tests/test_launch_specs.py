"""The launch specs agree with the kernels' C signatures, and PackedLaunch packs what it is given.

Everything runs on the CPU without CuPy: the signatures are parsed from ``raw_kernels/*.cu``;
the specs are built with the compiler and the CuPy array check replaced by stand-ins, so the
argument lists are compared by name, order and C type. PackedLaunch is driven with a fake
kernel and a fake ``cuLaunchKernel``. On the GPU every packed launch is exercised by the e2e
tests.
"""
import ctypes
import re

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.kernels import launches, specs

# C parameter type -> the numpy scalar type a spec must hold for it ("ptr": an array argument)
_C_TYPES = {"afd_i32": np.int32, "afd_i64": np.int64, "afd_u64": np.uint64, "float": np.float32,
            "SlotGeometry": "SlotGeometry"}


def _c_signature(filename: str, name: str) -> list:
    """[(param name, numpy type, "ptr" or "SlotGeometry")] of kernel ``name`` in ``raw_kernels/filename``."""
    text = (kernels.KERNEL_DIR / filename).read_text()
    text = re.sub(r"//[^\n]*", "", text)
    match = re.search(rf"\b{name}\s*\((.*?)\)\s*\{{", text, re.S)
    assert match, f"{name} not found in {filename}"
    params = []
    for raw in match.group(1).split(","):
        decl = " ".join(raw.replace("__restrict__", "").split())
        param = decl.split()[-1].lstrip("*")
        if "*" in decl:
            params.append((param, "ptr"))
        else:
            ctype = decl.rsplit(" ", 1)[0].replace("const ", "")
            params.append((param, _C_TYPES[ctype]))
    return params


class _FakeArray:
    """Stands in for a CuPy array in a spec (the array check is replaced in these tests)."""


@pytest.fixture
def fake_specs(monkeypatch):
    monkeypatch.setattr(specs, "get_kernel", lambda *a, **kw: "kernel")
    monkeypatch.setattr(specs, "_array", lambda name, arr, dtype, min_size: _FakeArray())


_LAYOUT = wire.WindowLayout(num_regions=3, ring_depth=2, expert_per_rank=4, hidden_size=64,
                            itemsize=2, top_k=8, token_cap=8, routed_cap=64, shared_cap=4)


def _specs() -> dict:
    arr, geo = _FakeArray(), _LAYOUT.kernel_geometry()
    replies = dict(window=0x3000, geo=geo, num_ffn_ranks=2, ring=1, expected=arr,
                   expected_counts=arr, layer_idx=3, stage_idx=1, last_seen=arr, reply_flags=arr,
                   timeout_ns=10**9, status=0x1000)
    return {
        ("dispatch.cu", "afd_dispatch_plan"): kernels.dispatch_plan_spec(
            topk_ids=arr, num_partials=64, num_ffn_ranks=2, expert_per_rank=4, routed_cap=64,
            layer_idx=3, chunk_hist=arr, local_rank=arr, expert_counts=arr, expert_start=arr, rank_offsets=arr,
            verdict=arr, done_counter=arr, status=0x1000),
        ("dispatch.cu", "afd_dispatch_scatter"): kernels.dispatch_scatter_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            num_partials=64, top_k=8, expert_per_rank=4, num_ffn_ranks=2, chunk_hist=arr,
            local_rank=arr, expert_start=arr, rank_offsets=arr, expert_counts=arr, verdict=arr,
            peer_windows=arr, geo=geo, ring=1, has_shared=1, pos_out=arr, src_rank=0,
            layer_idx=3, stage_idx=0, hdr_flags=0, seq_counters=arr, expected=arr,
            expected_counts=arr, done_counter=arr),
        ("combine.cu", "afd_wait_replies"): kernels.wait_replies_spec(**replies),
        ("combine.cu", "afd_combine"): kernels.combine_spec(
            dtype_code=0, out=0x4000, num_tokens=8, hidden_size=64, topk_ids=arr,
            topk_weights=arr, pos=arr, top_k=8, expert_per_rank=4, has_shared=1, out_scale=1.0,
            done_counter=arr, **replies),
        ("wait_any.cu", "afd_wait_any"): kernels.wait_any_spec(
            window=0x3000, geo=geo, last_seen=arr, scan_start=arr, counts_snapshot=arr, timeout_ns=10**9,
            doorbell=0x5000, ticket=7),
        ("reply.cu", "afd_reply"): kernels.reply_spec(
            dtype_code=1, dst_window=0x3000, geo=geo, src_rank=1, ring=1, routed_out=0,
            num_routed=0, shared_out=0x6000, num_shared=3, hidden_size=64, header_src=0x7000,
            seq=5, done_counter=arr),
        ("ffn_graph.cu", "afd_graph_stage"): specs.graph_stage_spec(
            doorbell=0x5000, geo=geo, expert_per_rank=4, is_dedup=0, src_rank=1, num_attn_ranks=3,
            token_cap=8, routed_cap=64, shared_cap=4, routed_bucket=32, shared_bucket=4,
            num_layers=3, layers_per_chunk=2, routed_offs=arr, shared_offs=0x6000, reply_seqs=arr,
            state=arr, replay_counter=arr, records=0x7000, num_records=8, record_words=16),
        ("ffn_graph.cu", "afd_graph_gather"): specs.graph_gather_spec(
            dtype_code=0, window=0x3000, geo=geo, state=arr, hidden_size=64, routed_staging=0x8000,
            shared_staging=0, routed_bucket=32, shared_bucket=4),
        ("ffn_graph.cu", "afd_graph_reply"): specs.graph_reply_spec(
            dtype_code=2, own_window=0x3000, peer_windows=arr, geo=geo, src_rank=1, state=arr,
            routed_outs=arr, shared_out=0, hidden_size=64, done_counter=arr, routed_bucket=32,
            shared_bucket=4, num_chunks=2),
    }


def test_every_spec_matches_its_kernel_signature(fake_specs):
    """Same parameter names, same order, same C types as the .cu signature."""
    built = _specs()
    assert {name for _, name in built} == {name for entries in kernels.FILE_KERNELS.values()
                                           for name, _ in entries}
    for (filename, name), spec in built.items():
        c_params = _c_signature(filename, name)
        assert list(spec.names) == [c_name for c_name, _ in c_params], name
        for spec_name, value, (c_name, c_type) in zip(spec.names, spec.args, c_params):
            if c_type == "ptr":
                # an array, or a raw address (8 bytes, like the pointer)
                assert isinstance(value, (_FakeArray, np.uint64)), (name, spec_name, type(value))
            elif c_type == "SlotGeometry":
                assert isinstance(value, np.void)
                assert value.dtype == wire.WindowLayout.KERNEL_GEOMETRY_DTYPE, (name, spec_name)
            else:
                assert type(value) is c_type, (name, spec_name, type(value), c_type)


def test_specs_use_the_block_sizes_of_the_limit_table(fake_specs):
    built = _specs()
    limits = kernels.KERNEL_LIMITS
    blocks = {"afd_dispatch_plan": "PLAN_THREADS", "afd_dispatch_scatter": "SCATTER_THREADS",
              "afd_wait_replies": "WAIT_REPLIES_THREADS", "afd_combine": "COMBINE_THREADS",
              "afd_wait_any": "WAIT_ANY_THREADS", "afd_reply": "REPLY_THREADS",
              "afd_graph_stage": "REPLY_THREADS", "afd_graph_gather": "REPLY_THREADS",
              "afd_graph_reply": "REPLY_THREADS"}
    for (filename, name), spec in built.items():
        assert spec.block == limits[blocks[name]], name
        text = (kernels.KERNEL_DIR / filename).read_text()
        assert re.search(rf"__launch_bounds__\({blocks[name]}\)\s*\n\s*{name}\(", text), name


def test_specs_reject_a_geometry_that_does_not_fit(fake_specs):
    arr = _FakeArray()
    with pytest.raises(ValueError, match="geo must be a WindowLayout.kernel_geometry"):
        kernels.wait_any_spec(window=1, geo={"flags_bytes": 0}, last_seen=arr, scan_start=arr,
                              counts_snapshot=arr, timeout_ns=1, doorbell=1, ticket=1)
    other = wire.WindowLayout(**{**_LAYOUT.as_dict(), "expert_per_rank": 5}).kernel_geometry()
    with pytest.raises(ValueError, match="header_words = 17, expected 16"):
        kernels.dispatch_scatter_spec(
            dtype_code=0, hidden=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            num_partials=64, top_k=8, expert_per_rank=4, num_ffn_ranks=2, chunk_hist=arr,
            local_rank=arr, expert_start=arr, rank_offsets=arr, expert_counts=arr, verdict=arr,
            peer_windows=arr, geo=other, ring=1, has_shared=1, pos_out=arr, src_rank=0,
            layer_idx=3, stage_idx=0, hdr_flags=0, seq_counters=arr, expected=arr,
            expected_counts=arr, done_counter=arr)
    with pytest.raises(ValueError, match="ring must lie in"):
        kernels.reply_spec(dtype_code=1, dst_window=1, geo=_LAYOUT.kernel_geometry(), src_rank=0,
                           ring=2, routed_out=0, num_routed=0, shared_out=0, num_shared=0,
                           hidden_size=8, header_src=1, seq=1, done_counter=arr)


def test_grids_of_the_specs(fake_specs):
    built = _specs()
    assert built[("dispatch.cu", "afd_dispatch_scatter")].grid == kernels.scatter_grid(8, 8, 1) == 9
    assert kernels.scatter_grid(0, 8, 1) == 1 and kernels.scatter_grid(4096, 8, 1) == kernels.MAX_BLOCKS
    assert built[("combine.cu", "afd_combine")].grid == kernels.combine_grid(8) == 8
    assert kernels.combine_grid(0) == 1
    assert built[("reply.cu", "afd_reply")].grid == kernels.reply_grid(3) == 1
    assert built[("dispatch.cu", "afd_dispatch_plan")].shared_mem == 4 * 8
    assert built[("dispatch.cu", "afd_dispatch_plan")].grid == kernels.plan_grid(64) == 1
    assert kernels.plan_grid(0) == 1 and kernels.plan_grid(257) == 2


class _Kernel:
    class kernel:
        ptr = 0xF00D


def _param(packed, i, ctype):
    address = ctypes.cast(packed.params_ptr, ctypes.POINTER(ctypes.c_void_p))[i]
    return ctypes.cast(address, ctypes.POINTER(ctype))[0]


def test_packed_launch_packs_sets_and_launches():
    geo = _LAYOUT.kernel_geometry()
    values = {"a": np.uint64(0xDEADBEEF00), "n": np.int32(-7), "off": np.int64(1 << 40),
              "scale": np.float32(0.5), "count": np.uint32(3), "geo": geo}
    spec = kernels.LaunchSpec(_Kernel(), 5, 256, 128, tuple(values), tuple(values.values()))
    packed = kernels.PackedLaunch(spec)
    calls = []
    packed._launch_kernel = lambda *a: calls.append(a)  # cupy.cuda.driver.launchKernel

    got = [_param(packed, 0, ctypes.c_uint64), _param(packed, 1, ctypes.c_int32),
           _param(packed, 2, ctypes.c_int64), _param(packed, 3, ctypes.c_float),
           _param(packed, 4, ctypes.c_uint32)]
    assert got == [0xDEADBEEF00, -7, 1 << 40, 0.5, 3]
    geo_address = ctypes.cast(packed.params_ptr, ctypes.POINTER(ctypes.c_void_p))[5]
    assert ctypes.string_at(geo_address, geo.dtype.itemsize) == geo.tobytes()
    packed.set("n", 12345)
    packed.set("a", 0x1234)
    other = wire.WindowLayout(**{**_LAYOUT.as_dict(), "ring_depth": 3}).kernel_geometry()
    packed.set("geo", other)
    assert _param(packed, 1, ctypes.c_int32) == 12345 and _param(packed, 0, ctypes.c_uint64) == 0x1234
    assert ctypes.string_at(geo_address, geo.dtype.itemsize) == other.tobytes()
    assert packed.get("n") == 12345 and packed.get("geo") == other.tobytes()
    with pytest.raises(ValueError, match="needs 72 bytes"):
        packed.set("geo", b"short")
    packed.launch(0xABC)
    packed.launch(0xABC, grid=9)
    assert calls == [(0xF00D, 5, 1, 1, 256, 1, 1, 128, 0xABC, packed.params_ptr, 0),
                     (0xF00D, 9, 1, 1, 256, 1, 1, 128, 0xABC, packed.params_ptr, 0)]


def test_packed_launch_takes_an_array_by_its_device_pointer():
    class _Array:  # the attributes of a cupy.ndarray that PackedLaunch reads
        class data:
            ptr = 0xC0FFEE

    spec = kernels.LaunchSpec(_Kernel(), 1, 32, 0, ("buf",), (_Array(),))
    assert _param(kernels.PackedLaunch(spec), 0, ctypes.c_uint64) == 0xC0FFEE


def test_packed_launch_rejects_untyped_arguments():
    spec = kernels.LaunchSpec(_Kernel(), 1, 32, 0, ("n",), (7,))
    with pytest.raises(TypeError, match="argument n has type int"):
        kernels.PackedLaunch(spec)


def test_backend_sets_only_arguments_its_specs_have(fake_specs):
    """Every ``<launch>.set("name", ...)`` of the cuda backend names an argument of that kernel."""
    backends = kernels.KERNEL_DIR.parent / "afd_cupy" / "backends"
    source = "\n".join((backends / name).read_text() for name in ("cuda_attention.py", "cuda_ffn.py"))
    by_var = {"plan": "afd_dispatch_plan", "scatter": "afd_dispatch_scatter",
              "wait": "afd_wait_replies", "combine": "afd_combine",
              "launch": None}  # `launch`: wait_any and reply
    names = {name: set(spec.names) for (_, name), spec in _specs().items()}
    sets = re.findall(r"\b(\w+)\.set\(\"(\w+)\"", source)
    sets = [(var, arg) for var, arg in sets if var != "self"]
    assert len(sets) >= 19
    for var, arg in sets:
        kernel = by_var[var]
        allowed = names[kernel] if kernel else names["afd_wait_any"] | names["afd_reply"]
        assert arg in allowed, (var, arg)


def test_launches_module_has_no_cupy_import_at_module_level():
    assert launches.__dict__.get("cupy") is None and specs.__dict__.get("cupy") is None
