"""CPU checks of raw_kernels/ and afd_cupy.kernels: no GPU (and no CuPy) needed.

The wire.cuh mirror (constants, limits, struct SlotGeometry) is parsed textually and compared
with wire.py and kernels.KERNEL_LIMITS; the loader's cache key is checked to follow header
edits; the device plan's index formula is modelled in numpy and compared with the planner, and
the device's reply verdict (wire.reply_verdict) with the errors of wire.decode_header +
wire.check_reply. If NVRTC happens to
be loadable, every kernel file is also compiled for sm_90 (skipped otherwise).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from afd_cupy import config, errors, kernels, wire
from afd_cupy.routing import planner

from helpers import kernels as kh

KERNEL_FILES = ("common/wire.cuh", "common/payload.cuh", "common/fp8.cuh", "common/block.cuh",
                "common/publish.cuh",
                "attention/dispatch.cu", "attention/combine.cu", "attention/reply_check.cuh",
                "attention/plan_block.cuh", "attention/dedup_attn.cuh", "attention/dedup_attn.cu",
                "attention/dedup_attn_fused.cu", "ffn/wait_any.cuh", "ffn/wait_any.cu", "ffn/reply.cu", "ffn/fp8_rows.cu",
                "ffn/dedup_ffn.cuh", "ffn/dedup_ffn.cu", "ffn/ffn_graph.cuh", "ffn/ffn_graph_stage.cu",
                "ffn/ffn_graph_rows.cu", "model/gate.cu", "probes/wire_constants.cu", "probes/bench.cu")
#: headers a kernel file may include (NVRTC runs without system headers), by their path in raw_kernels/
KERNEL_HEADERS = {name for name in KERNEL_FILES if name.endswith(".cuh")}
WIRE_CUH = "common/wire.cuh"
ALL_KERNELS = {**kernels.FILE_KERNELS, **kernels.PROBE_KERNELS}
_CONSTEXPR_RE = re.compile(r"constexpr\s+\w+\s+(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))\s*;")


def _cuh_constants() -> dict:
    text = (kernels.KERNEL_DIR / WIRE_CUH).read_text()
    return {name: int(value, 0) for name, value in _CONSTEXPR_RE.findall(text)}


def test_kernel_files_exist_and_define_their_kernels():
    for name in KERNEL_FILES:
        assert (kernels.KERNEL_DIR / name).is_file(), name
    for filename, entries in ALL_KERNELS.items():
        text = (kernels.KERNEL_DIR / filename).read_text()
        assert '#include "common/wire.cuh"' in text
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
        assert set(includes) <= KERNEL_HEADERS, f"{name} includes {includes}"
    for module in (kernels.KERNEL_DIR.parent / "afd_cupy" / "kernels").glob("*.py"):
        assert "jitify" not in module.read_text().replace("no jitify", ""), module


def test_wire_cuh_constants_match_wire_py_and_kernel_limits():
    parsed = _cuh_constants()
    expected = kh.expected_wire_constants()
    mirrored = [name for name in kh.WIRE_CONSTANT_NAMES if kh.is_mirrored_constant(name)]
    missing = [name for name in mirrored if name not in parsed]
    assert not missing, f"wire.cuh lacks {missing}"
    for name in mirrored:
        assert parsed[name] == expected[name], f"{name}: wire.cuh {parsed[name]} != {expected[name]}"
    assert parsed["MAGIC"] == wire.MAGIC and parsed["HDR_FIXED_WORDS"] == wire.HDR_FIXED_WORDS


def test_every_limit_of_wire_cuh_is_in_the_python_table():
    parsed = _cuh_constants()
    for name, value in kernels.KERNEL_LIMITS.items():
        assert parsed[name] == value, f"{name}: wire.cuh {parsed.get(name)} != {value}"
    in_cuh = {name for name in parsed if name.endswith("_THREADS") or name.startswith("MAX_")}
    assert in_cuh <= set(kernels.KERNEL_LIMITS), in_cuh - set(kernels.KERNEL_LIMITS)
    for name in ("CHUNK", "MAX_BLOCKS", "MAX_FFN_RANKS", "MAX_TOP_K", "MAX_EXPERTS", "ROWS_PER_BLOCK"):
        assert getattr(kernels, name) == kernels.KERNEL_LIMITS[name]


def test_kernel_files_use_the_limits_of_wire_cuh_only():
    """No second copy of a limit or block size in a .cu file (wire.cuh defines them once)."""
    for name in KERNEL_FILES[1:]:
        text = re.sub(r"//[^\n]*", "", (kernels.KERNEL_DIR / name).read_text())
        assert not re.search(r"constexpr\s+\w+\s+(MAX_\w+|\w+_THREADS|\w+_WARPS|ROWS_PER_BLOCK|CHUNK)\b",
                             text), name
        assert not re.search(r"__launch_bounds__\(\d", text), f"{name}: literal block size"


_STRUCT_RE = re.compile(r"struct\s+SlotGeometry\s*\{(.*?)\n\};", re.S)
_C_SIZES = {"afd_i64": (np.int64, 8), "afd_i32": (np.int32, 4)}


def test_slot_geometry_struct_matches_the_numpy_dtype():
    """Field names, order and C types of struct SlotGeometry == WindowLayout.KERNEL_GEOMETRY_DTYPE,
    and the natural C layout of those fields == the numpy offsets and itemsize."""
    body = _STRUCT_RE.search((kernels.KERNEL_DIR / WIRE_CUH).read_text()).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = re.findall(r"^\s*(afd_i64|afd_i32)\s+(\w+)\s*;", body, re.M)
    dtype = wire.WindowLayout.KERNEL_GEOMETRY_DTYPE
    assert [name for _, name in fields] == list(dtype.names)
    offset, align = 0, 1
    for ctype, name in fields:
        np_type, size = _C_SIZES[ctype]
        offset = -(-offset // size) * size
        assert dtype.fields[name][0] == np.dtype(np_type), name
        assert dtype.fields[name][1] == offset, name
        offset += size
        align = max(align, size)
    assert dtype.itemsize == -(-offset // align) * align == 72


def test_kernel_geometry_holds_the_layout():
    layout = wire.WindowLayout(num_regions=3, ring_depth=2, expert_per_rank=5, hidden_size=72,
                               itemsize=2, top_k=4, token_cap=40, routed_cap=90, shared_cap=14)
    geo = layout.kernel_geometry()
    assert isinstance(geo, np.void) and geo.dtype == wire.WindowLayout.KERNEL_GEOMETRY_DTYPE
    assert int(geo["header_words"]) == layout.header_words == 17
    assert (int(geo["flags_bytes"]), int(geo["slot_bytes"])) == (layout.flags_bytes, layout.slot_bytes)
    assert (int(geo["num_regions"]), int(geo["ring_depth"])) == (3, 2)
    for name, key in (("header", "off_header"), ("route_table", "off_route"), ("routed_x", "off_routed_x"),
                      ("shared_idx", "off_shared_idx"), ("shared_x", "off_shared_x")):
        assert int(geo[key]) == layout.field_offset(name)
    # what SlotGeometry::slot(base, region, ring) computes
    slot = int(geo["flags_bytes"]) + (2 * int(geo["ring_depth"]) + 1) * int(geo["slot_bytes"])
    assert slot == layout.slot_offset(2, 1)


def test_wire_constants_kernel_writes_every_name_in_order():
    text = (kernels.KERNEL_DIR / "probes" / "wire_constants.cu").read_text()
    start = text.index("values[] = {") + len("values[] = {")
    body = text[start:text.index("};", start)]
    body = re.sub(r"//[^\n]*", "", body)
    entries = [e.strip() for e in re.split(r",\s*(?![^()]*\))", body) if e.strip()]
    assert len(entries) == len(kh.WIRE_CONSTANT_NAMES)
    geometry = iter(wire.WindowLayout.KERNEL_GEOMETRY_DTYPE.names)
    for entry, name in zip(entries, kh.WIRE_CONSTANT_NAMES):
        if kh.is_mirrored_constant(name):
            assert entry == name, f"position of {name}: kernel writes {entry}"
        elif name == "GEO_SIZEOF":
            assert entry == "static_cast<afd_i64>(sizeof(SlotGeometry))", entry
        elif name.startswith("GEO_"):
            assert entry == f"AFD_GEO_OFFSET({next(geometry)})", f"position of {name}: {entry}"


def test_dtype_and_status_constants_consistent():
    parsed = _cuh_constants()
    assert kernels.DTYPE_CODES == {"bfloat16": parsed["DT_BF16"], "float16": parsed["DT_F16"],
                                   "float32": parsed["DT_F32"]}
    assert set(kernels.DTYPE_CODES) == set(config.PAYLOAD_DTYPES)
    for name in ("OK", "CAPACITY", "TIMEOUT", "BAD_HEADER", "REPLY_MISMATCH", "SHUTDOWN", "BAD_EXPERT"):
        code = getattr(wire, f"STATUS_{name}")
        assert parsed[f"STATUS_{name}"] == code and wire.STATUS_NAMES[code] == name
    for i, field in enumerate(wire.STATUS_FIELDS):
        assert getattr(wire, f"ST_{field.upper()}") == i == parsed[f"ST_{field.upper()}"]
    assert wire.STATUS_WORDS == parsed["STATUS_WORDS"] == len(wire.STATUS_FIELDS)
    assert kh.dtype_code("bfloat16") == 0 and kh.dtype_code(np.dtype(np.float16)) == 1
    assert kh.dtype_code("torch.float32") == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        kh.dtype_code("int8")


def test_status_record_decodes_words():
    words = np.array([wire.STATUS_CAPACITY, 2, -1, -1, -1, -1, 77, 64, 5], np.int64)
    assert wire.StatusRecord.decode(words) == wire.StatusRecord(1, 2, -1, -1, -1, -1, 77, 64, 5)
    assert wire.StatusRecord.decode(words).name == "CAPACITY"
    assert wire.StatusRecord.decode(np.zeros(wire.STATUS_WORDS, np.int64)).ok


def test_cache_key_follows_included_header(tmp_path, monkeypatch):
    for name in KERNEL_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(kernels.KERNEL_DIR / name, tmp_path / name)
    monkeypatch.setattr(kernels.loader, "KERNEL_DIR", tmp_path)  # "common/..." resolves in the copy
    dispatch, combine = tmp_path / "attention" / "dispatch.cu", tmp_path / "attention" / "combine.cu"
    key = kernels.source_key(dispatch)
    assert key == kernels.source_key(dispatch)
    assert key != kernels.source_key(combine)
    reply = tmp_path / "ffn" / "reply.cu"
    reply.write_text(reply.read_text() + "\n// edit\n")
    assert kernels.source_key(dispatch) == key  # unrelated file
    block = tmp_path / "common" / "block.cuh"  # included by dispatch.cu and by plan_block.cuh
    block.write_text(block.read_text() + "\n// edit\n")
    header_edited = kernels.source_key(dispatch)
    assert header_edited != key
    dispatch.write_text(dispatch.read_text() + "\n// edit\n")
    assert kernels.source_key(dispatch) not in (key, header_edited)


def test_cache_key_missing_header_names_it(tmp_path):
    (tmp_path / "k.cu").write_text('#include "nowhere.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nowhere.cuh"):
        kernels.source_key(tmp_path / "k.cu")


def test_name_expressions_and_chunks():
    assert kernels.kernel_name_expressions("attention/combine.cu") == ("afd_wait_replies", "afd_combine<0>", "afd_combine<1>", "afd_combine<2>")
    assert kernels.kernel_name_expressions("attention/dispatch.cu")[0] == "afd_dispatch_plan"
    assert kernels.kernel_name_expressions("ffn/wait_any.cu") == ("afd_wait_any",)
    assert kernels.kernel_name_expressions("attention/dedup_attn.cu") == (
        "afd_dedup_rows", "afd_dedup_scatter<0>", "afd_dedup_scatter<1>", "afd_dedup_scatter<2>",
        "afd_dedup_combine<0>", "afd_dedup_combine<1>", "afd_dedup_combine<2>")
    assert kernels.kernel_name_expressions("attention/dedup_attn_fused.cu") == (
        "afd_dedup_dispatch_fused<0>", "afd_dedup_dispatch_fused<1>", "afd_dedup_dispatch_fused<2>")
    assert kernels.kernel_name_expressions("probes/bench.cu") == ("afd_bench_stamp", "afd_bench_clock",
                                                                  "afd_trace_stamp")
    assert kernels.kernel_name_expressions(kernels.KERNEL_DIR / "probes" / "wire_constants.cu") == (
        "afd_read_wire_constants",)
    assert not set(kernels.FILE_KERNELS) & set(kernels.PROBE_KERNELS)
    assert [kernels.dispatch_num_chunks(n) for n in (0, 1, 256, 257, 4096 * 8)] == [0, 1, 1, 2, 128]


def test_import_does_not_import_cupy():
    code = ("import sys, afd_cupy.kernels, afd_cupy.kernels.status; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
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


# --- the device's reply verdict (wire.reply_verdict) agrees with the host's errors ------------
_EPR = 4
_WANT = wire.ReplyExpectation(peer=1, seq=2**32 + 77, layer_idx=9, stage_idx=1, routed_tokens=6,
                              shared_tokens=3)
_REPLY_FAULTS = {  # name -> (header word or "count0", value)
    "ok": (None, None), "magic": (wire.HDR_MAGIC, 0x12345678), "version": (wire.HDR_VERSION, 7),
    "negative_routed": (wire.HDR_ROUTED_TOKENS, -6), "negative_count": ("count0", -1),
    "negative_shared": (wire.HDR_SHARED_TOKENS, -3), "counts_sum": ("count0", 5),
    "shutdown": (wire.HDR_FLAGS, wire.FLAG_SHUTDOWN), "echo": (wire.HDR_ECHO_SEQ, 78),
    "layer": (wire.HDR_LAYER, 10), "stage": (wire.HDR_STAGE, 0),
    "routed": ("routed", 7), "shared": (wire.HDR_SHARED_TOKENS, 4),
    "dedup_flag": (wire.HDR_FLAGS, wire.FLAG_DEDUP)}  # a dedup reply to a pair receiver


def _reply_words(fault: str) -> np.ndarray:
    dispatch = wire.dispatch_header(seq=_WANT.seq, src_rank=0, layer_idx=_WANT.layer_idx,
                                    stage_idx=_WANT.stage_idx, num_tokens=5, shared_tokens=3,
                                    top_k=2, expert_counts=(2, 0, 3, 1))
    words = wire.encode_header(wire.reply_header(dispatch, seq=5, src_rank=_WANT.peer), _EPR)
    word, value = _REPLY_FAULTS[fault]
    if word == "count0":
        words[wire.HDR_FIXED_WORDS] = value
    elif word == "routed":  # consistent counts, but not what was sent
        words[wire.HDR_ROUTED_TOKENS] = value
        words[wire.HDR_FIXED_WORDS] += value - _WANT.routed_tokens
    elif word is not None:
        words[word] = value
    return words


def _host_error(words):
    try:
        wire.check_reply(wire.decode_header(words, _EPR), _WANT)
    except errors.AfdError as err:
        return err
    return None


@pytest.mark.parametrize("fault", sorted(_REPLY_FAULTS))
def test_reply_verdict_agrees_with_the_host_checks(fault):
    words = _reply_words(fault)
    record = wire.reply_verdict(words, _WANT, slot=3, ring=1, flag=_WANT.seq)
    code, count = record.code, record.count
    host = _host_error(words)
    if fault == "ok":
        assert host is None and record == wire.CLEAR_STATUS
        return
    assert (record.peer, record.slot, record.ring, record.layer) == (_WANT.peer, 3, 1, _WANT.layer_idx)
    device = record.error(layer_idx=_WANT.layer_idx, timeout_s=1.0)
    assert type(device) is type(host), (fault, record, host, device)
    want_code = {"magic": wire.STATUS_BAD_HEADER, "version": wire.STATUS_BAD_HEADER,
                 "dedup_flag": wire.STATUS_BAD_HEADER,
                 "shutdown": wire.STATUS_SHUTDOWN}.get(fault, wire.STATUS_BAD_HEADER
                                                      if fault.startswith(("negative", "counts"))
                                                      else wire.STATUS_REPLY_MISMATCH)
    assert code == want_code
    if code == wire.STATUS_REPLY_MISMATCH:  # same field and values as the host's ProtocolError
        assert (device.field, device.expected, device.observed) == (host.field, host.expected, host.observed)
        assert str(device) == str(host)
    if code == wire.STATUS_BAD_HEADER:
        assert count == {"magic": wire.HDR_MAGIC, "version": wire.HDR_VERSION,
                         "dedup_flag": wire.HDR_FLAGS,
                         "negative_shared": wire.HDR_SHARED_TOKENS}.get(fault, wire.HDR_ROUTED_TOKENS)


# --- the same, for the replies of a dedup dispatch (afd_wait_replies with dedup = 1) -------------
# dispatch: 4 rows, routed 6 (counts 2, 0, 3, 1), 2 shared rows, top_k 2
_DEDUP_WANT = wire.ReplyExpectation(peer=1, seq=2**32 + 77, layer_idx=9, stage_idx=1,
                                    routed_tokens=6, shared_tokens=2, num_rows=4)
_ROWS_WORD = wire.HDR_FIXED_WORDS + _EPR
_DEDUP_FAULTS = {  # name -> (header word, value, (code, ST_COUNT))
    "ok": (None, None, (wire.STATUS_OK, 0)),  # a clear status block (wire.CLEAR_STATUS)
    "missing_flag": (wire.HDR_FLAGS, 0, (wire.STATUS_BAD_HEADER, wire.HDR_FLAGS)),
    "pair_shutdown": (wire.HDR_FLAGS, wire.FLAG_SHUTDOWN, (wire.STATUS_BAD_HEADER, wire.HDR_FLAGS)),
    "shutdown": (wire.HDR_FLAGS, wire.FLAG_SHUTDOWN | wire.FLAG_DEDUP, (wire.STATUS_SHUTDOWN, -1)),
    "version": (wire.HDR_VERSION, 2, (wire.STATUS_BAD_HEADER, wire.HDR_VERSION)),
    "negative_count": ("count0", -1, (wire.STATUS_BAD_HEADER, wire.HDR_ROUTED_TOKENS)),
    "counts_sum": ("count0", 3, (wire.STATUS_BAD_HEADER, wire.HDR_ROUTED_TOKENS)),
    "negative_rows": (_ROWS_WORD, -1, (wire.STATUS_BAD_HEADER, _ROWS_WORD)),
    "rows_over_routed": (_ROWS_WORD, 7, (wire.STATUS_BAD_HEADER, _ROWS_WORD)),
    "routed_over_rows_k": (_ROWS_WORD, 2, (wire.STATUS_BAD_HEADER, _ROWS_WORD)),
    "shared_over_rows": (wire.HDR_SHARED_TOKENS, 5, (wire.STATUS_BAD_HEADER, _ROWS_WORD)),
    "zero_topk": (wire.HDR_TOPK, 0, (wire.STATUS_BAD_HEADER, _ROWS_WORD)),
    "echo": (wire.HDR_ECHO_SEQ, 78, (wire.STATUS_REPLY_MISMATCH, wire.HDR_ECHO_SEQ)),
    "layer": (wire.HDR_LAYER, 10, (wire.STATUS_REPLY_MISMATCH, wire.HDR_LAYER)),
    "routed": ("routed", 7, (wire.STATUS_REPLY_MISMATCH, wire.HDR_ROUTED_TOKENS)),
    "shared": (wire.HDR_SHARED_TOKENS, 3, (wire.STATUS_REPLY_MISMATCH, wire.HDR_SHARED_TOKENS)),
    "num_rows": (_ROWS_WORD, 5, (wire.STATUS_REPLY_MISMATCH, _ROWS_WORD)),
}


def _dedup_reply_words(fault: str) -> np.ndarray:
    dispatch = wire.dispatch_header(seq=_DEDUP_WANT.seq, src_rank=0, layer_idx=_DEDUP_WANT.layer_idx,
                                    stage_idx=_DEDUP_WANT.stage_idx, num_tokens=5, shared_tokens=2,
                                    top_k=2, expert_counts=(2, 0, 3, 1), wire_mode="dedup", num_rows=4)
    words = wire.encode_header(wire.reply_header(dispatch, seq=5, src_rank=_DEDUP_WANT.peer), _EPR)
    word, value, _ = _DEDUP_FAULTS[fault]
    if word == "count0":
        words[wire.HDR_FIXED_WORDS] = value
    elif word == "routed":  # consistent counts and sizes, but not what was sent
        words[wire.HDR_ROUTED_TOKENS] = value
        words[wire.HDR_FIXED_WORDS] += value - _DEDUP_WANT.routed_tokens
    elif word is not None:
        words[word] = value
    return words


@pytest.mark.parametrize("fault", sorted(_DEDUP_FAULTS))
def test_reply_verdict_agrees_with_the_host_checks_in_dedup_mode(fault):
    words = _dedup_reply_words(fault)
    assert words.size == _ROWS_WORD + 1
    want = _DEDUP_WANT
    record = wire.reply_verdict(words, want, wire_mode="dedup", slot=3, ring=1, flag=want.seq)
    code, count = record.code, record.count
    assert (code, count) == _DEDUP_FAULTS[fault][2]
    try:
        wire.check_reply(wire.decode_header(words, _EPR, wire_mode="dedup"), want)
        host = None
    except errors.AfdError as err:
        host = err
    if fault == "ok":
        assert host is None
        return
    device = record.error(layer_idx=want.layer_idx, timeout_s=1.0, expert_per_rank=_EPR)
    assert type(device) is type(host), (fault, record, host, device)
    if code == wire.STATUS_REPLY_MISMATCH:  # same field and values as the host's ProtocolError
        assert (device.field, device.expected, device.observed) == (host.field, host.expected, host.observed)
        assert str(device) == str(host)
    if count == _ROWS_WORD:
        assert "num_rows" in str(device)


def test_reply_verdict_dedup_size_faults_report_the_nearest_valid_num_rows():
    """ST_EXPECTED of an impossible dedup size: the num_rows the other sizes allow."""
    def check(fault):
        record = wire.reply_verdict(_dedup_reply_words(fault), _DEDUP_WANT, wire_mode="dedup")
        return record.expected, record.observed
    assert check("rows_over_routed") == (6, 7)    # num_rows <= routed_tokens = 6
    assert check("routed_over_rows_k") == (3, 2)  # routed 6 needs >= ceil(6 / top_k 2) = 3 rows
    assert check("shared_over_rows") == (5, 4)    # shared_tokens 5 needs >= 5 rows
    assert check("zero_topk") == (2, 4)         # no partials fit: only shared_tokens bounds it


@pytest.mark.parametrize("num_tokens,top_k,num_ffn,num_experts,has_shared", [
    (0, 2, 2, 8, 1), (1, 1, 1, 3, 1), (7, 6, 3, 10, 1), (300, 8, 4, 10, 0), (97, 4, 2, 5, 1),
    (1000, 2, 3, 64, 1), (50, 40, 33, 99, 1)])
def test_device_dedup_rows_formula_matches_reference(num_tokens, top_k, num_ffn, num_experts,
                                                      has_shared):
    """numpy model of afd_dedup_rows: one key per (token, rank) pair on the token's first partial
    there (2j: shared here, 2j+1: not), chunk histograms of CHUNK partials, scan, and
    row = (odd key ? shared_rows[j] : 0) + chunk base + rank among equal keys in the chunk."""
    from afd_cupy.testing import dedup_reference

    rng = np.random.default_rng(num_tokens * 7 + num_ffn)
    epr = -(-num_experts // num_ffn)
    ids = rng.integers(0, num_experts, (num_tokens, top_k)).astype(np.int32)
    ref = dedup_reference.plan_reference(ids, num_ffn, epr, has_shared=bool(has_shared),
                                         num_experts=num_experts)
    ranks = ids // epr
    num_keys, flat = 2 * num_ffn, ranks.reshape(-1)
    shared_rank = np.full(num_tokens, -1)
    for t in range(num_tokens):
        if has_shared:  # the kernel's dedup_shared_rank: smallest cyclic distance from t % F
            shared_rank[t] = ranks[t][np.argmin((ranks[t] - t % num_ffn) % num_ffn)]
    keys = np.full(flat.size, -1)
    for p in range(flat.size):
        t, k = divmod(p, top_k)
        if not (ranks[t, :k] == ranks[t, k]).any():
            keys[p] = 2 * ranks[t, k] + (shared_rank[t] != ranks[t, k])
    num_chunks = kernels.dispatch_num_chunks(flat.size)
    hist = np.zeros((num_chunks, num_keys), np.int64)
    local = np.zeros(flat.size, np.int64)
    for c in range(num_chunks):
        chunk = keys[c * kernels.CHUNK:(c + 1) * kernels.CHUNK]
        for i, key in enumerate(chunk):
            if key >= 0:
                local[c * kernels.CHUNK + i] = np.count_nonzero(chunk[:i] == key)
                hist[c, key] += 1
    bases, totals = np.cumsum(hist, axis=0) - hist, hist.sum(axis=0)
    row_map = np.full((num_tokens, num_ffn), -1)
    for p in np.flatnonzero(keys >= 0):
        key = keys[p]
        row_map[p // top_k, key // 2] = (totals[key - 1] if key % 2 else 0) + bases[p // kernels.CHUNK, key] + local[p]
    np.testing.assert_array_equal(shared_rank, ref.shared_rank)
    np.testing.assert_array_equal(row_map, ref.row_map)
    np.testing.assert_array_equal(totals[0::2], ref.shared_rows)
    np.testing.assert_array_equal(totals[0::2] + totals[1::2], ref.num_rows)
    assert hist.max(initial=0) <= kernels.CHUNK and num_keys <= 2 * kernels.MAX_FFN_RANKS  # packing


def test_gate_cu_scoring_codes_match_the_python_copy():
    # afd_gate_topk's scoring codes (its limits are wire.cuh's, checked with the others)
    text = (kernels.KERNEL_DIR / "model" / "gate.cu").read_text()
    constants = {name: int(value, 0) for name, value in _CONSTEXPR_RE.findall(text)}
    assert {"SCORE_SOFTMAX": constants["SCORE_SOFTMAX"], "SCORE_SIGMOID": constants["SCORE_SIGMOID"]} == {
        "SCORE_SOFTMAX": kernels.specs.GATE_SCORING["softmax"], "SCORE_SIGMOID": kernels.specs.GATE_SCORING["sigmoid"]}
