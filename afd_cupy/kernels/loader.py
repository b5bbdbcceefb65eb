"""One cached loader for ``raw_kernels/<role>/*.cu`` (docs/design/kernels.md).

:func:`load_module` compiles a ``.cu`` file once per (file, options, name expressions, device)
with NVRTC (``-std=c++17 -I raw_kernels``, no jitify). The cache key covers the contents of the
file and of every header it includes (``#include "..."``, transitively); the same digest is
passed to NVRTC as ``-DAFD_SOURCE_KEY=...`` so that CuPy's on-disk cache, which only hashes the
top-level source, is invalidated by a header edit too. ``AFD_KERNEL_CACHE=0``
(:func:`afd_cupy.runtime.env.kernel_cache_enabled`) disables the in-process cache.

Where the sources are (:data:`KERNEL_DIR`, :func:`find_kernel_dir`): the repository keeps them
in the top-level ``raw_kernels/``; a wheel ships them inside the package as
``afd_cupy/raw_kernels/`` (``pyproject.toml`` maps the one onto the other). The installed
package's copy is taken first, the source checkout's second (a checkout on ``PYTHONPATH``, an
editable install).

Importing this module does not import CuPy.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from afd_cupy.runtime import env
from afd_cupy.wire.dtypes import PAYLOAD_DTYPES

#: the kernels inside an installed package (a wheel: ``afd_cupy/raw_kernels/``)
PACKAGE_KERNEL_DIR = Path(__file__).resolve().parent.parent / "raw_kernels"
#: the kernels of a source checkout (the repository's top-level ``raw_kernels/``)
SOURCE_KERNEL_DIR = Path(__file__).resolve().parent.parent.parent / "raw_kernels"


def find_kernel_dir() -> Path:
    """The directory of the kernel sources: :data:`PACKAGE_KERNEL_DIR` when it exists (an
    installed wheel), else :data:`SOURCE_KERNEL_DIR` when it exists (a checkout, an editable
    install), else :data:`PACKAGE_KERNEL_DIR` (loads then fail naming both places)."""
    for candidate in (PACKAGE_KERNEL_DIR, SOURCE_KERNEL_DIR):
        if candidate.is_dir():
            return candidate
    return PACKAGE_KERNEL_DIR


KERNEL_DIR = find_kernel_dir()
BASE_OPTIONS = ("-std=c++17",)

#: payload dtype name -> template argument DT of the payload kernels (wire.cuh DT_*), derived
#: from the one dtype table (:data:`afd_cupy.wire.dtypes.PAYLOAD_DTYPES`)
DTYPE_CODES = {name: payload.kernel_code for name, payload in PAYLOAD_DTYPES.items()}

#: production kernels of each file (relative to KERNEL_DIR: common/ holds headers only, each
#: kernel sits in the folder of its role: attention/, ffn/, model/); True marks a template over
#: the payload dtype code
FILE_KERNELS = {
    "attention/dispatch.cu": (("afd_dispatch_plan", False), ("afd_dispatch_scatter", True),
                              ("afd_dispatch_fused", True)),
    "attention/routing.cu": (("afd_own_routing", True),),
    "attention/combine.cu": (("afd_wait_replies", False), ("afd_combine", True)),
    "attention/dedup_attn.cu": (("afd_dedup_rows", False), ("afd_dedup_scatter", True),
                                ("afd_dedup_combine", True)),
    "attention/dedup_attn_fused.cu": (("afd_dedup_dispatch_fused", True),),
    "ffn/wait_any.cu": (("afd_wait_any", False),),
    "ffn/reply.cu": (("afd_reply", True),),
    "ffn/fp8_rows.cu": (("afd_fp8_dequant_rows", True),),
    "ffn/dedup_ffn.cu": (("afd_dedup_expand", True), ("afd_dedup_reply", True)),
    "ffn/ffn_graph_stage.cu": (("afd_graph_stage", False), ("afd_graph_wait_stage", False)),
    "ffn/ffn_graph_rows.cu": (("afd_graph_gather", True), ("afd_graph_reply", True),
                              ("afd_graph_dedup_expand", True), ("afd_graph_dedup_reply", True)),
    "attention/dedup_attn_ll.cu": (("afd_dedup_dispatch_ll", True),),
    "model/gate.cu": (("afd_gate_topk", True),),
}

#: probes for tests and tools only (same format as FILE_KERNELS)
PROBE_KERNELS = {
    "probes/wire_constants.cu": (("afd_read_wire_constants", False),),
    "probes/bench.cu": (("afd_bench_stamp", False), ("afd_bench_clock", False),
                        ("afd_trace_stamp", False)),
}

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_MODULE_CACHE: dict = {}
_KERNEL_CACHE: dict = {}


def kernel_path(filename) -> Path:
    """Absolute path of a kernel source: ``filename`` itself if absolute, else in KERNEL_DIR.
    FileNotFoundError naming the places searched when there is no such file."""
    path = Path(filename)
    path = path if path.is_absolute() else KERNEL_DIR / path
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} not found (kernel sources are searched in "
                                f"{PACKAGE_KERNEL_DIR}, then {SOURCE_KERNEL_DIR}; a wheel built "
                                "from pyproject.toml ships them in the package)")
    return path


def _resolve_include(name: str, including: Path) -> Path:
    for directory in (including.parent, KERNEL_DIR):
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f'#include "{name}" in {including} not found in '
                            f"{including.parent} or {KERNEL_DIR}")


def source_key(filename) -> str:
    """sha256 hex digest of a source and of every header it includes, transitively."""
    digest = hashlib.sha256()
    pending, seen = [kernel_path(filename).resolve()], set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + text + b"\0")
        includes = _INCLUDE_RE.findall(text.decode("utf-8", errors="replace"))
        pending.extend(reversed([_resolve_include(name, path).resolve() for name in includes]))
    return digest.hexdigest()


def _registered(filename) -> tuple:
    """The (name, is_template) entries of a file in FILE_KERNELS or PROBE_KERNELS."""
    path = Path(filename)
    path = path if path.is_absolute() else KERNEL_DIR / path
    try:
        key = path.relative_to(KERNEL_DIR).as_posix()
    except ValueError:
        key = path.name
    return FILE_KERNELS.get(key) or PROBE_KERNELS.get(key, ())


def kernel_name_expressions(filename) -> tuple:
    """Name expressions compiled for a file: every kernel, templates for every dtype code."""
    exprs = []
    for name, is_template in _registered(filename):
        if is_template:
            exprs.extend(f"{name}<{code}>" for code in sorted(DTYPE_CODES.values()))
        else:
            exprs.append(name)
    return tuple(exprs)


def load_module(filename, *, options=(), name_expressions=()):
    """``cupy.RawModule`` of ``raw_kernels/<filename>`` (e.g. ``"attention/dispatch.cu"``),
    compiled once per (file, options, name_expressions, device, contents of the file and its
    headers)."""
    import cupy

    path = kernel_path(filename)
    key_digest = source_key(path)
    key = (str(path), tuple(options), tuple(name_expressions), cupy.cuda.runtime.getDevice(),
           key_digest)
    use_cache = env.kernel_cache_enabled()
    if use_cache and key in _MODULE_CACHE:
        return _MODULE_CACHE[key]
    full_options = BASE_OPTIONS + (f"-I{KERNEL_DIR}", f"-I{path.parent}",
                                   f"-DAFD_SOURCE_KEY=0x{key_digest[:16]}") + tuple(options)
    module = cupy.RawModule(code=path.read_text(), options=full_options,
                            name_expressions=tuple(name_expressions) or None)
    if use_cache:
        _MODULE_CACHE[key] = module
    return module


def get_kernel(filename, name: str, *, dtype_code=None):
    """``cupy.RawKernel`` ``name`` (``name<dtype_code>`` for a template) of a kernel file."""
    import cupy

    key = (str(filename), name, dtype_code, cupy.cuda.runtime.getDevice())
    use_cache = env.kernel_cache_enabled()
    if use_cache and key in _KERNEL_CACHE:
        return _KERNEL_CACHE[key]
    expr = name if dtype_code is None else f"{name}<{int(dtype_code)}>"
    exprs = kernel_name_expressions(filename)
    if expr not in exprs:
        exprs = exprs + (expr,)
    kernel = load_module(filename, name_expressions=exprs).get_function(expr)
    if use_cache:
        _KERNEL_CACHE[key] = kernel
    return kernel


def clear_cache() -> None:
    """Forget every compiled module and kernel of this process."""
    _MODULE_CACHE.clear()
    _KERNEL_CACHE.clear()
