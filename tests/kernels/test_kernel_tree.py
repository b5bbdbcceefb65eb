"""The shape of raw_kernels/ (docs/design/kernels.md, file map): one folder per role, no file
over 400 lines, includes spelled from raw_kernels/, and one device home for the seq rule.

Text checks only (no CuPy, no NVRTC): tests/kernels/test_nvrtc_compile.py compiles the files.
"""
from __future__ import annotations

import re

from afd_cupy.kernels import loader

ROOT = loader.KERNEL_DIR
#: the folders of raw_kernels/ and what each may hold
FOLDERS = {"common": "headers of both roles", "attention": "Attention-side kernels",
           "ffn": "FFN-side kernels", "model": "model kernels (the gate)",
           "probes": "probes for tests and tools"}
MAX_LINES = 400
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
#: "x + 1" where x names a seq: the increment that only next_seq (common/wire.cuh) may spell
_SEQ_INCREMENT_RE = re.compile(r"\b\w*seq\w*(?:\[[^\]]*\])?\s*\+\s*1\b")


def _sources():
    return sorted(p for p in ROOT.rglob("*") if p.suffix in (".cu", ".cuh"))


def _code(path) -> str:
    return re.sub(r"//[^\n]*", "", path.read_text())


def test_every_source_sits_in_a_role_folder():
    sources = _sources()
    assert sources
    misplaced = [p.relative_to(ROOT).as_posix() for p in sources
                 if len(p.relative_to(ROOT).parts) != 2 or p.parent.name not in FOLDERS]
    assert not misplaced, f"kernel sources outside {sorted(FOLDERS)}: {misplaced}"
    assert not list((ROOT / "common").glob("*.cu")), "common/ holds headers only"
    registered = set(loader.FILE_KERNELS) | set(loader.PROBE_KERNELS)
    on_disk = {p.relative_to(ROOT).as_posix() for p in sources if p.suffix == ".cu"}
    assert registered == on_disk, (sorted(registered - on_disk), sorted(on_disk - registered))


def test_no_source_over_400_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_includes_are_spelled_from_raw_kernels():
    """#include "common/wire.cuh", never "wire.cuh": the same name from every folder, found
    through -I raw_kernels by NVRTC and by the loader's cache key."""
    for path in _sources():
        for name in _INCLUDE_RE.findall(path.read_text()):
            assert (ROOT / name).is_file(), f"{path.relative_to(ROOT)} includes {name!r}"


def test_the_seq_increment_is_written_once():
    """wire.py's seq rule has one device home, next_seq in common/wire.cuh; the senders
    (dispatch, dedup dispatch, graph stage) call it."""
    wire_cuh = ROOT / "common" / "wire.cuh"
    assert re.search(r"afd_i64 next_seq\(afd_i64 prev_seq\) \{ return prev_seq \+ 1; \}",
                     wire_cuh.read_text())
    spelled = {p.relative_to(ROOT).as_posix(): _SEQ_INCREMENT_RE.findall(_code(p))
               for p in _sources() if p != wire_cuh}
    assert not {k: v for k, v in spelled.items() if v}, spelled
    for name in ("attention/dispatch.cu", "attention/dedup_attn.cuh", "ffn/ffn_graph_stage.cu"):
        assert "next_seq(" in _code(ROOT / name), name
