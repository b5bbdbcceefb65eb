"""The launch specs agree with the kernels' C signatures, and PackedLaunch packs what it is given.

Both run on the CPU: the signatures are parsed from ``raw_kernels/*.cu``; the specs are built
with the compiler and the CuPy array check replaced by stand-ins, so only the argument lists
(order and C types) are compared. On the GPU every packed launch is exercised by the e2e tests.
"""
import ctypes
import re

import numpy as np
import pytest

from afd_cupy import kernels

# C parameter type -> the numpy scalar type a spec must hold for it ("ptr": an array argument)
_C_TYPES = {"afd_i32": np.int32, "afd_i64": np.int64, "afd_u64": np.uint64, "float": np.float32}


def _c_signature(filename: str, name: str) -> list:
    """[(param name, numpy type or "ptr")] of kernel ``name`` in ``raw_kernels/filename``."""
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
    monkeypatch.setattr(kernels, "get_kernel", lambda *a, **kw: "kernel")
    monkeypatch.setattr(kernels, "_array", lambda name, arr, dtype, min_size: _FakeArray())


def _specs() -> dict:
    arr = _FakeArray()
    common = dict(off_header=256, off_routed_x=1024, off_shared_x=4096)
    return {
        ("dispatch.cu", "afd_dispatch_plan"): kernels.dispatch_plan_spec(
            topk_ids=arr, num_partials=64, num_ffn_ranks=2, expert_per_rank=4, routed_cap=64,
            chunk_hist=arr, local_rank=arr, expert_counts=arr, expert_start=arr, rank_offsets=arr,
            done_counter=arr, status_ptr=0x1000),
        ("dispatch.cu", "afd_dispatch_scatter"): kernels.dispatch_scatter_spec(
            dtype_code=0, hidden_ptr=0x2000, num_tokens=8, hidden_size=64, topk_ids=arr,
            num_partials=64, top_k=8, expert_per_rank=4, num_ffn_ranks=2, chunk_hist=arr,
            local_rank=arr, expert_start=arr, rank_offsets=arr, expert_counts=arr,
            peer_windows=arr, slot_offset=512, flags_index=1, off_route=512, off_shared_idx=2048,
            hdr_words=16, has_shared=1, pos_out=arr, src_rank=0, layer_idx=3, stage_idx=0,
            hdr_flags=0, seq_counters=arr, expected=arr, done_counter=arr, status_ptr=0x1000,
            **common),
        ("combine.cu", "afd_wait_replies"): kernels.wait_replies_spec(
            window_ptr=0x3000, num_ffn_ranks=2, flags_bytes=256, slot_bytes=8192, ring_depth=2,
            ring=1, off_header=256, expected=arr, last_seen=arr, timeout_ns=10**9, status_ptr=0x1000),
        ("combine.cu", "afd_combine"): kernels.combine_spec(
            dtype_code=0, out_ptr=0x4000, num_tokens=8, hidden_size=64, topk_ids=arr,
            topk_weights=arr, pos=arr, top_k=8, expert_per_rank=4, num_ffn_ranks=2, has_shared=1,
            window_ptr=0x3000, flags_bytes=256, slot_bytes=8192, ring_depth=2, ring=1,
            hdr_words=16, expected=arr, last_seen=arr, timeout_ns=10**9, out_scale=1.0,
            done_counter=arr, status_ptr=0x1000, **common),
        ("wait_any.cu", "afd_wait_any"): kernels.wait_any_spec(
            window_ptr=0x3000, num_slots=4, last_seen=arr, scan_start=arr, off_header=256,
            flags_bytes=256, slot_bytes=8192, hdr_words=16, timeout_ns=10**9,
            doorbell_ptr=0x5000, ticket=7),
        ("reply.cu", "afd_reply"): kernels.reply_spec(
            dtype_code=1, dst_window_ptr=0x3000, slot_offset=512, flags_index=1,
            routed_out_ptr=0, num_routed=0, shared_out_ptr=0x6000, num_shared=3, hidden_size=64,
            header_src_ptr=0x7000, hdr_words=16, seq=5, done_counter=arr, **common),
    }


def test_every_spec_matches_its_kernel_signature(fake_specs):
    specs = _specs()
    assert {name for _, name in specs} >= {name for kernels_of_file in kernels.FILE_KERNELS.values()
                                            for name, _ in kernels_of_file
                                            if name.startswith(("afd_dispatch", "afd_wait", "afd_combine",
                                                                "afd_reply"))}
    for (filename, name), spec in specs.items():
        c_params = _c_signature(filename, name)
        assert len(spec.args) == len(c_params), (name, spec.names, c_params)
        for spec_name, value, (c_name, c_type) in zip(spec.names, spec.args, c_params):
            if c_type == "ptr":
                # an array, or a raw address (8 bytes, like the pointer)
                assert isinstance(value, (_FakeArray, np.uint64)), (name, spec_name, c_name, type(value))
            else:
                assert type(value) is c_type, (name, spec_name, c_name, type(value), c_type)


def test_grids_of_the_specs(fake_specs):
    specs = _specs()
    assert specs[("dispatch.cu", "afd_dispatch_scatter")].grid == kernels.scatter_grid(8, 8, 1) == 9
    assert kernels.scatter_grid(0, 8, 1) == 1 and kernels.scatter_grid(4096, 8, 1) == kernels.MAX_BLOCKS
    assert specs[("combine.cu", "afd_combine")].grid == kernels.combine_grid(8) == 8
    assert kernels.combine_grid(0) == 1
    assert specs[("reply.cu", "afd_reply")].grid == kernels.reply_grid(3) == 1
    assert specs[("dispatch.cu", "afd_dispatch_plan")].shared_mem == 4 * 8


def test_packed_launch_packs_sets_and_launches(monkeypatch):
    import cupy

    calls = []
    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", lambda *a: calls.append(a))

    class Kernel:
        class kernel:
            ptr = 0xF00D

    values = {"a_ptr": np.uint64(0xDEADBEEF00), "n": np.int32(-7), "off": np.int64(1 << 40),
              "scale": np.float32(0.5), "count": np.uint32(3)}
    spec = kernels.LaunchSpec(Kernel(), 5, 256, 128, tuple(values), tuple(values.values()))
    packed = kernels.PackedLaunch(spec)

    def param(i, ctype):
        address = ctypes.cast(packed.params_ptr, ctypes.POINTER(ctypes.c_void_p))[i]
        return ctypes.cast(address, ctypes.POINTER(ctype))[0]

    got = [param(0, ctypes.c_uint64), param(1, ctypes.c_int32), param(2, ctypes.c_int64),
           param(3, ctypes.c_float), param(4, ctypes.c_uint32)]
    assert got == [0xDEADBEEF00, -7, 1 << 40, 0.5, 3]
    packed.set("n", 12345)
    packed.set("a_ptr", 0x1234)
    assert param(1, ctypes.c_int32) == 12345 and param(0, ctypes.c_uint64) == 0x1234
    assert packed.get("n") == 12345
    packed.launch(0xABC)
    packed.launch(0xABC, grid=9)
    assert calls == [(0xF00D, 5, 1, 1, 256, 1, 1, 128, 0xABC, packed.params_ptr, 0),
                     (0xF00D, 9, 1, 1, 256, 1, 1, 128, 0xABC, packed.params_ptr, 0)]


def test_packed_launch_rejects_untyped_arguments():
    class Kernel:
        class kernel:
            ptr = 1

    spec = kernels.LaunchSpec(Kernel(), 1, 32, 0, ("n",), (7,))
    with pytest.raises(TypeError, match="argument n has type int"):
        kernels.PackedLaunch(spec)


def test_backend_sets_only_arguments_its_specs_have(fake_specs):
    """Every ``<launch>.set("name", ...)`` of the cuda backend names an argument of that kernel."""
    source = (kernels.KERNEL_DIR.parent / "afd_cupy" / "backends" / "cuda.py").read_text()
    by_var = {"plan": "afd_dispatch_plan", "scatter": "afd_dispatch_scatter",
              "combine": "afd_combine", "launch": None}  # `launch`: wait_any and reply
    names = {name: set(spec.names) for (_, name), spec in _specs().items()}
    sets = re.findall(r"\b(\w+)\.set\(\"(\w+)\"", source)
    assert len(sets) >= 15
    for var, arg in sets:
        kernel = by_var[var]
        allowed = names[kernel] if kernel else names["afd_wait_any"] | names["afd_reply"]
        assert arg in allowed, (var, arg)
