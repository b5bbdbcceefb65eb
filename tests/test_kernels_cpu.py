"""CPU checks of raw_kernels/ and afd_cupy.kernels: no GPU (and no CuPy) needed.

The wire.cuh mirror is parsed textually and compared with wire.py and kernels.py; the loader's
cache key is checked to follow header edits; the device plan's index formula is checked against
the planner's reference in numpy. If NVRTC happens to be loadable, every kernel file is also
compiled for sm_90 (skipped otherwise).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from afd_cupy import config, kernels, planner, wire

KERNEL_FILES = ("wire.cuh", "dispatch.cu", "combine.cu", "wait_any.cu", "reply.cu", "wire_constants.cu")
_CONSTEXPR_RE = re.compile(r"constexpr\s+\w+\s+(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))\s*;")


def _cuh_constants() -> dict:
    text = (kernels.KERNEL_DIR / "wire.cuh").read_text()
    return {name: int(value, 0) for name, value in _CONSTEXPR_RE.findall(text)}


def test_kernel_files_exist_and_define_their_kernels():
    for name in KERNEL_FILES:
        assert (kernels.KERNEL_DIR / name).is_file(), name
    for filename, entries in kernels.FILE_KERNELS.items():
        text = (kernels.KERNEL_DIR / filename).read_text()
        assert '#include "wire.cuh"' in text
        for name, is_template in entries:
            if is_template:
                pattern = r"template\s*<int DT>\s*__global__\s+void\s+(__launch_bounds__\(\w+\)\s*)?" + name + r"\("
            else:
                pattern = r'extern "C" __global__\s+void\s+(__launch_bounds__\(\w+\)\s*)?\s*' + name + r"\("
            assert re.search(pattern, text), f"{name} not defined as expected in {filename}"


def test_no_forbidden_includes_or_jitify():
    for name in KERNEL_FILES:
        text = (kernels.KERNEL_DIR / name).read_text()
        includes = re.findall(r'#\s*include\s*[<"]([^>"]+)[>"]', text)
        assert set(includes) <= {"wire.cuh"}, f"{name} includes {includes}"
    assert "jitify" not in (kernels.KERNEL_DIR.parent / "afd_cupy" / "kernels.py").read_text().replace(
        "no jitify", "")


def test_wire_cuh_constants_match_wire_py_and_kernels_py():
    parsed = _cuh_constants()
    expected = kernels.expected_wire_constants()
    mirrored = [name for name in kernels.WIRE_CONSTANT_NAMES if not name.startswith("PROBE_")]
    missing = [name for name in mirrored if name not in parsed]
    assert not missing, f"wire.cuh lacks {missing}"
    for name in mirrored:
        assert parsed[name] == expected[name], f"{name}: wire.cuh {parsed[name]} != {expected[name]}"
    assert parsed["MAGIC"] == wire.MAGIC and parsed["HDR_FIXED_WORDS"] == wire.HDR_FIXED_WORDS


def test_wire_constants_kernel_writes_every_name_in_order():
    text = (kernels.KERNEL_DIR / "wire_constants.cu").read_text()
    body = text[text.index("values[] = {") + len("values[] = {"):text.index("};")]
    body = re.sub(r"//[^\n]*", "", body)
    entries = [e.strip() for e in re.split(r",\s*(?![^()]*\))", body) if e.strip()]
    assert len(entries) == len(kernels.WIRE_CONSTANT_NAMES)
    for entry, name in zip(entries, kernels.WIRE_CONSTANT_NAMES):
        if not name.startswith("PROBE_"):
            assert entry == name, f"position of {name}: kernel writes {entry}"


def test_dtype_and_status_constants_consistent():
    parsed = _cuh_constants()
    assert kernels.DTYPE_CODES == {"bfloat16": parsed["DT_BF16"], "float16": parsed["DT_F16"],
                                   "float32": parsed["DT_F32"]}
    assert set(kernels.DTYPE_CODES) == set(config.PAYLOAD_DTYPES)
    for name in ("OK", "CAPACITY", "TIMEOUT", "BAD_HEADER", "ECHO_MISMATCH", "SHUTDOWN", "BAD_EXPERT"):
        code = getattr(kernels, f"STATUS_{name}")
        assert parsed[f"STATUS_{name}"] == code and kernels.STATUS_NAMES[code] == name
    for i, field in enumerate(kernels.STATUS_FIELDS):
        assert getattr(kernels, f"ST_{field.upper()}") == i == parsed[f"ST_{field.upper()}"]
    assert kernels.STATUS_WORDS == parsed["STATUS_WORDS"] == len(kernels.STATUS_FIELDS)
    assert kernels.CHUNK == parsed["CHUNK"]
    assert kernels.dtype_code("bfloat16") == 0 and kernels.dtype_code(np.dtype(np.float16)) == 1
    assert kernels.dtype_code("torch.float32") == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        kernels.dtype_code("int8")


def test_read_status_decodes_words():
    words = np.array([kernels.STATUS_CAPACITY, 2, -1, -1, -1, -1, 77, 64], np.int64)
    status = kernels.read_status(words)
    assert status == {"code": 1, "name": "CAPACITY", "peer": 2, "slot": -1, "ring": -1,
                      "expected": -1, "observed": -1, "count": 77, "cap": 64}
    assert kernels.read_status(np.zeros(8, np.int64))["name"] == "OK"


def test_cache_key_follows_included_header(tmp_path):
    for name in KERNEL_FILES:
        shutil.copy(kernels.KERNEL_DIR / name, tmp_path / name)
    key = kernels.source_key(tmp_path / "dispatch.cu")
    assert key == kernels.source_key(tmp_path / "dispatch.cu")
    assert key != kernels.source_key(tmp_path / "combine.cu")
    (tmp_path / "reply.cu").write_text((tmp_path / "reply.cu").read_text() + "\n// edit\n")
    assert kernels.source_key(tmp_path / "dispatch.cu") == key  # unrelated file
    (tmp_path / "wire.cuh").write_text((tmp_path / "wire.cuh").read_text() + "\n// edit\n")
    header_edited = kernels.source_key(tmp_path / "dispatch.cu")
    assert header_edited != key
    (tmp_path / "dispatch.cu").write_text((tmp_path / "dispatch.cu").read_text() + "\n// edit\n")
    assert kernels.source_key(tmp_path / "dispatch.cu") not in (key, header_edited)


def test_cache_key_missing_header_names_it(tmp_path):
    (tmp_path / "k.cu").write_text('#include "nowhere.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nowhere.cuh"):
        kernels.source_key(tmp_path / "k.cu")


def test_name_expressions_and_chunks():
    assert kernels.kernel_name_expressions("combine.cu") == ("afd_wait_replies", "afd_combine<0>", "afd_combine<1>", "afd_combine<2>")
    assert kernels.kernel_name_expressions("dispatch.cu")[0] == "afd_dispatch_plan"
    assert kernels.kernel_name_expressions("wait_any.cu") == ("afd_wait_any",)
    assert [kernels.dispatch_num_chunks(n) for n in (0, 1, 256, 257, 4096 * 8)] == [0, 1, 1, 2, 128]


def test_layout_kernel_args_match_layout():
    layout = wire.WindowLayout(num_regions=3, ring_depth=2, expert_per_rank=5, hidden_size=72,
                               itemsize=2, top_k=4, token_cap=40, routed_cap=90, shared_cap=14)
    args = kernels.layout_kernel_args(layout)
    assert args["hdr_words"] == layout.header_words == 17
    assert args["flags_bytes"] == layout.flags_bytes and args["slot_bytes"] == layout.slot_bytes
    for name, key in (("header", "off_header"), ("route_table", "off_route"), ("routed_x", "off_routed_x"),
                      ("shared_idx", "off_shared_idx"), ("shared_x", "off_shared_x")):
        assert args[key] == layout.field_offset(name)


def test_import_does_not_import_cupy():
    code = "import sys, afd_cupy.kernels; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=kernels.KERNEL_DIR.parent)


@pytest.mark.parametrize("num_tokens,top_k,num_ffn,num_experts", [
    (0, 2, 2, 8), (1, 1, 1, 3), (7, 6, 3, 10), (300, 8, 4, 10), (97, 4, 2, 5), (1000, 2, 3, 64)])
def test_device_plan_formula_matches_reference(num_tokens, top_k, num_ffn, num_experts):
    """numpy model of afd_dispatch_plan: slot = expert_start[e] + chunk base + local rank."""
    rng = np.random.default_rng(num_tokens * 31 + top_k)
    epr = -(-num_experts // num_ffn)
    ids = rng.integers(0, num_experts, (num_tokens, top_k)).astype(np.int32)
    ref = planner.plan_dispatch_reference(ids, num_ffn, epr, num_experts=num_experts)
    flat, padded = ids.reshape(-1), num_ffn * epr
    num_chunks = kernels.dispatch_num_chunks(flat.size)
    hist = np.zeros((num_chunks, padded), np.int64)
    local_rank = np.zeros(flat.size, np.int64)
    for c in range(num_chunks):
        chunk = flat[c * kernels.CHUNK:(c + 1) * kernels.CHUNK]
        for t, e in enumerate(chunk):
            local_rank[c * kernels.CHUNK + t] = np.count_nonzero(chunk[:t] == e)
            hist[c, e] += 1
    counts = hist.sum(axis=0)
    bases = np.cumsum(hist, axis=0) - hist  # exclusive scan over chunks, per expert
    expert_start = np.cumsum(counts) - counts
    slot = expert_start[flat] + bases[np.arange(flat.size) // kernels.CHUNK, flat] + local_rank
    rank_offsets = np.append(expert_start[::epr][:num_ffn], flat.size)
    np.testing.assert_array_equal(counts, ref.expert_counts)
    np.testing.assert_array_equal(rank_offsets, ref.rank_offsets)
    np.testing.assert_array_equal(slot - rank_offsets[flat // epr], ref.pos.reshape(-1))
    order = np.empty(flat.size, np.int64)
    order[slot] = np.arange(flat.size)
    np.testing.assert_array_equal(order, ref.order)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as err:  # noqa: BLE001 - no CuPy, or no libnvrtc on this machine
        pytest.skip(f"NVRTC not available ({type(err).__name__}: {err})")
    return nvrtc


@pytest.mark.parametrize("filename", sorted(kernels.FILE_KERNELS))
def test_nvrtc_compiles_every_kernel(filename):
    nvrtc = _nvrtc()
    source = (kernels.KERNEL_DIR / filename).read_text()
    prog = nvrtc.createProgram(source, filename, (), ())
    try:
        exprs = kernels.kernel_name_expressions(filename)
        for expr in exprs:
            nvrtc.addNameExpression(prog, expr)
        options = kernels.BASE_OPTIONS + (f"-I{kernels.KERNEL_DIR}", "-arch=compute_90",
                                          "--device-as-default-execution-space")
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC failed on {filename}:\n{nvrtc.getProgramLog(prog)}")
        log = nvrtc.getProgramLog(prog).strip("\x00 \n")
        assert "warning" not in log, log
        for expr in exprs:
            assert nvrtc.getLoweredName(prog, expr)
    finally:
        nvrtc.destroyProgram(prog)
