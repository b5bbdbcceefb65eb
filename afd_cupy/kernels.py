"""One cached loader for ``raw_kernels/*.cu`` and thin typed launch wrappers (DESIGN §7).

Loader: :func:`load_module` compiles a ``.cu`` file once per (file, options, name
expressions, device) with NVRTC (``-std=c++17 -I raw_kernels``, no jitify). The cache key
covers the contents of the file and of every header it includes (``#include "..."``,
transitively); the same digest is passed to NVRTC as ``-DAFD_SOURCE_KEY=...`` so that CuPy's
on-disk cache, which only hashes the top-level source, is invalidated by a header edit too.
``AFD_KERNEL_CACHE=0`` (:func:`afd_cupy.env.kernel_cache_enabled`) disables the in-process cache.

Launch wrappers take keyword arguments only: raw addresses (``*_ptr``: windows, peer
mappings, pinned host memory) as ``int``, scratch buffers as CuPy arrays, and an optional
``stream`` (``cupy.cuda.Stream``, default: the current stream). They validate cheaply (dtype and
size of the arrays, signs of the sizes), raise ``ValueError`` naming the argument, compute the
grid and launch asynchronously. None of them synchronizes. Kernels that use a ``done_counter``
(uint32 [1], zero, device) leave it at zero again; one counter per kernel in flight.

Status block (``int64[STATUS_WORDS]``, any device-visible memory): the first error of a kernel
is latched with ``atomicCAS`` on word ``ST_CODE``; the host reads it with :func:`read_status` and
must clear it before reusing it. The cuda backend keeps it in device memory and mirrors it into
pinned host memory at its synchronization points (:class:`StatusBlock`); the kernels work with
either (the tests use a :class:`PinnedInt64`).

Importing this module does not import CuPy.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from afd_cupy import env, wire

KERNEL_DIR = Path(__file__).resolve().parent.parent / "raw_kernels"
BASE_OPTIONS = ("-std=c++17",)

CHUNK = 256  # partials per block of afd_dispatch_plan
MAX_BLOCKS = 1024
MAX_FFN_RANKS = 256  # static shared arrays of afd_dispatch_scatter
MAX_TOP_K = 64  # static shared arrays of afd_combine
MAX_EXPERTS = 8192  # dynamic shared memory of afd_dispatch_plan (4 B per expert)
ROWS_PER_BLOCK = 8  # warps of 256-thread row-copy kernels (scatter, reply)

DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}

# The protocol's status and doorbell words live in wire.py (re-exported here for the kernels).
from afd_cupy.wire import (DB_FLAG, DB_HEADER, DB_SLOT, DB_STATUS, DB_TICKET,  # noqa: E402
                           ST_CAP, ST_CODE, ST_COUNT, ST_EXPECTED, ST_OBSERVED, ST_PEER,
                           ST_RING, ST_SLOT, STATUS_BAD_EXPERT, STATUS_BAD_HEADER,
                           STATUS_CAPACITY, STATUS_FIELDS, STATUS_NAMES, STATUS_OK,
                           STATUS_REPLY_MISMATCH, STATUS_SHUTDOWN, STATUS_TIMEOUT, STATUS_WORDS)

# Kernels of each file; True marks a template over the payload dtype code.
FILE_KERNELS = {
    "dispatch.cu": (("afd_dispatch_plan", False), ("afd_dispatch_scatter", True)),
    "combine.cu": (("afd_wait_replies", False), ("afd_combine", True)),
    "wait_any.cu": (("afd_wait_any", False),),
    "reply.cu": (("afd_reply", True),),
    "wire_constants.cu": (("afd_read_wire_constants", False),),
    "bench.cu": (("afd_bench_stamp", False), ("afd_bench_clock", False)),
}

# Order of the values written by afd_read_wire_constants (raw_kernels/wire_constants.cu).
WIRE_CONSTANT_NAMES = (
    "MAGIC", "VERSION", "ALIGN", "FLAG_SHUTDOWN",
    "HDR_MAGIC", "HDR_VERSION", "HDR_SEQ", "HDR_SRC_RANK", "HDR_LAYER", "HDR_STAGE",
    "HDR_NUM_TOKENS", "HDR_ROUTED_TOKENS", "HDR_SHARED_TOKENS", "HDR_TOPK", "HDR_FLAGS",
    "HDR_ECHO_SEQ", "HDR_FIXED_WORDS",
    "STATUS_OK", "STATUS_CAPACITY", "STATUS_TIMEOUT", "STATUS_BAD_HEADER",
    "STATUS_REPLY_MISMATCH", "STATUS_SHUTDOWN", "STATUS_BAD_EXPERT",
    "ST_CODE", "ST_PEER", "ST_SLOT", "ST_RING", "ST_EXPECTED", "ST_OBSERVED", "ST_COUNT",
    "ST_CAP", "STATUS_WORDS",
    "DB_TICKET", "DB_STATUS", "DB_SLOT", "DB_FLAG", "DB_HEADER",
    "DT_BF16", "DT_F16", "DT_F32", "CHUNK",
    # probes of the device dtype helpers (not constants of wire.cuh)
    "PROBE_ITEMSIZE_BF16", "PROBE_ITEMSIZE_F16", "PROBE_ITEMSIZE_F32",
    "PROBE_BF16_BITS_OF_1_5", "PROBE_F16_BITS_OF_1_5",
    "PROBE_4_TIMES_BF16_0xC010", "PROBE_4_TIMES_F16_0xC080",
)


def expected_wire_constants() -> dict:
    """name -> value that afd_read_wire_constants must return (from wire.py and this module)."""
    values = {name: getattr(wire, name) for name in (
        "MAGIC", "VERSION", "ALIGN", "FLAG_SHUTDOWN", "HDR_MAGIC", "HDR_VERSION", "HDR_SEQ",
        "HDR_SRC_RANK", "HDR_LAYER", "HDR_STAGE", "HDR_NUM_TOKENS", "HDR_ROUTED_TOKENS",
        "HDR_SHARED_TOKENS", "HDR_TOPK", "HDR_FLAGS", "HDR_ECHO_SEQ", "HDR_FIXED_WORDS")}
    here = globals()
    values.update({name: here[name] for name in WIRE_CONSTANT_NAMES
                   if name.startswith(("STATUS_", "ST_", "DB_"))})
    values.update(DT_BF16=DTYPE_CODES["bfloat16"], DT_F16=DTYPE_CODES["float16"],
                  DT_F32=DTYPE_CODES["float32"], CHUNK=CHUNK,
                  PROBE_ITEMSIZE_BF16=2, PROBE_ITEMSIZE_F16=2, PROBE_ITEMSIZE_F32=4,
                  PROBE_BF16_BITS_OF_1_5=0x3FC0, PROBE_F16_BITS_OF_1_5=0x3E00,
                  PROBE_4_TIMES_BF16_0xC010=-9, PROBE_4_TIMES_F16_0xC080=-9)
    assert set(values) == set(WIRE_CONSTANT_NAMES)
    return values


def dtype_code(dtype) -> int:
    """Payload dtype code of a name, numpy/cupy dtype or torch dtype."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    name = str(name if name is not None else dtype).replace("torch.", "")
    if name not in DTYPE_CODES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {dtype!r}")
    return DTYPE_CODES[name]


def dispatch_num_chunks(num_partials: int) -> int:
    """Blocks (chunks of CHUNK partials) of afd_dispatch_plan for ``num_partials``; 0 for 0."""
    return -(-int(num_partials) // CHUNK)


# --- loader ------------------------------------------------------------------------------------
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_MODULE_CACHE: dict = {}
_KERNEL_CACHE: dict = {}


def kernel_path(filename) -> Path:
    """Absolute path of a kernel source: ``filename`` itself if absolute, else in KERNEL_DIR."""
    path = Path(filename)
    return path if path.is_absolute() else KERNEL_DIR / path


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


def kernel_name_expressions(filename) -> tuple:
    """Name expressions compiled for a file: every kernel, templates for every dtype code."""
    exprs = []
    for name, is_template in FILE_KERNELS.get(Path(filename).name, ()):
        if is_template:
            exprs.extend(f"{name}<{code}>" for code in sorted(DTYPE_CODES.values()))
        else:
            exprs.append(name)
    return tuple(exprs)


def load_module(filename, *, options=(), name_expressions=()):
    """``cupy.RawModule`` of ``raw_kernels/<filename>``, compiled once per (file, options,
    name_expressions, device, contents of the file and its headers)."""
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


# --- pinned host words -------------------------------------------------------------------------
class PinnedInt64:
    """Zeroed int64 words in pinned host memory: ``array`` (numpy view) and ``ptr`` (address).

    With unified addressing the host address is valid on the device as is, so ``ptr`` is what
    the kernels take as a status block, doorbell or header source. Keep the object alive as
    long as any kernel may touch the memory.
    """

    def __init__(self, num_words: int):
        import cupy

        if num_words <= 0:
            raise ValueError(f"num_words must be positive, got {num_words}")
        self._mem = cupy.cuda.alloc_pinned_memory(num_words * 8)
        self.array = np.frombuffer(self._mem, dtype=np.int64, count=num_words)
        self.array[:] = 0
        self.ptr = int(self._mem.ptr)

    @property
    def int32(self) -> np.ndarray:
        """int32 view of the same memory (``2 * num_words`` words)."""
        return self.array.view(np.int32)


class StatusBlock:
    """The kernels' status block in device memory plus a pinned host mirror of it.

    ``ptr``: device int64 [STATUS_WORDS], what the kernels take as ``status_ptr``; ``host``:
    numpy int64 [STATUS_WORDS] view of the pinned mirror, as fresh as the last completed
    :meth:`enqueue_mirror`.

    NOTE: the status lives on the device because every block of the scatter and the combine
    reads it (the scatter's "error latched, send nothing" check, the combine's re-check): in
    pinned host memory each of those reads is a PCIe round trip. The host only reads it after a
    stream synchronization, so one D2H copy enqueued right before that synchronization is
    enough. Buffers the host reads *without* synchronizing (the wait_any doorbell) or writes
    for a kernel (the reply header staging) stay in pinned memory.
    """

    NBYTES = STATUS_WORDS * 8

    def __init__(self, device_ptr: int, host: np.ndarray, runtime, owners=()):
        if host.dtype != np.int64 or host.size < STATUS_WORDS or not host.flags.c_contiguous:
            raise ValueError(f"host must be a contiguous int64 array of >= {STATUS_WORDS} words")
        self.ptr = int(device_ptr)
        self.host = host
        self._runtime = runtime  # cupy.cuda.runtime (or a test fake with the same calls)
        self._owners = owners  # keep the device array and the pinned memory alive

    @classmethod
    def allocate(cls) -> "StatusBlock":
        """A zeroed device status block and its zeroed pinned mirror (synchronous)."""
        import cupy

        device = cupy.zeros(STATUS_WORDS, cupy.int64)
        pinned = PinnedInt64(STATUS_WORDS)
        cupy.cuda.Device().synchronize()  # the zero fill precedes any kernel on any stream
        return cls(device.data.ptr, pinned.array, cupy.cuda.runtime, owners=(device, pinned))

    def enqueue_mirror(self, stream_ptr: int) -> None:
        """Enqueue the device -> pinned copy on ``stream_ptr``; read :attr:`host` after a sync."""
        rt = self._runtime
        rt.memcpyAsync(self.host.ctypes.data, self.ptr, self.NBYTES, rt.memcpyDeviceToHost,
                       stream_ptr)

    def read(self) -> wire.StatusRecord:
        """:func:`read_status` of the host mirror (no CUDA call)."""
        return read_status(self.host)

    def clear(self, stream_ptr: int) -> None:
        """Zero the mirror now and the device words in ``stream_ptr``'s order (no sync)."""
        self.host[:STATUS_WORDS] = 0
        self._runtime.memsetAsync(self.ptr, 0, self.NBYTES, stream_ptr)


def read_status(status) -> wire.StatusRecord:
    """Decode a status block (numpy int64 view, e.g. ``PinnedInt64.array``)."""
    return wire.StatusRecord.decode(status)


def layout_kernel_args(layout: wire.WindowLayout) -> dict:
    """Window geometry arguments shared by the wrappers, from a :class:`wire.WindowLayout`."""
    return dict(flags_bytes=layout.flags_bytes, slot_bytes=layout.slot_bytes,
                ring_depth=layout.ring_depth, hdr_words=layout.header_words,
                off_header=layout.field_offset("header"),
                off_route=layout.field_offset("route_table"),
                off_routed_x=layout.field_offset("routed_x"),
                off_shared_idx=layout.field_offset("shared_idx"),
                off_shared_x=layout.field_offset("shared_x"))


@dataclass(frozen=True)
class DispatchScratch:
    """Device scratch of one dispatch in flight, sized for ``max_partials`` (CuPy arrays).

    ``chunk_hist`` int32 [max(1, chunks), E]; ``local_rank``, ``pos`` int32 [max(1, NK)];
    ``expert_counts``, ``expert_start`` int32 [E]; ``rank_offsets`` int32 [F + 1];
    ``plan_done``, ``scatter_done`` uint32 [1] zeroed done counters.
    """

    chunk_hist: object
    local_rank: object
    pos: object
    expert_counts: object
    expert_start: object
    rank_offsets: object
    plan_done: object
    scatter_done: object

    @classmethod
    def allocate(cls, max_partials: int, num_ffn_ranks: int, expert_per_rank: int) -> "DispatchScratch":
        import cupy

        num_experts = num_ffn_ranks * expert_per_rank
        rows = max(1, dispatch_num_chunks(max_partials))
        return cls(chunk_hist=cupy.zeros((rows, num_experts), cupy.int32),
                   local_rank=cupy.zeros(max(1, max_partials), cupy.int32),
                   pos=cupy.zeros(max(1, max_partials), cupy.int32),
                   expert_counts=cupy.zeros(num_experts, cupy.int32),
                   expert_start=cupy.zeros(num_experts, cupy.int32),
                   rank_offsets=cupy.zeros(num_ffn_ranks + 1, cupy.int32),
                   plan_done=cupy.zeros(1, cupy.uint32), scatter_done=cupy.zeros(1, cupy.uint32))


# --- argument checks ---------------------------------------------------------------------------
def _count(name: str, value, *, low: int = 0, high: int = 2**31 - 1) -> np.int32:
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return np.int32(value)


def _i64(name: str, value, *, low: int = -(2**63)) -> np.int64:
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return np.int64(value)


def _address(name: str, value, *, allow_null: bool = False) -> np.uint64:
    value = int(value)
    if value < 0 or value >= 2**64 or (value == 0 and not allow_null):
        raise ValueError(f"{name} must be a non-null device-visible address, got {value:#x}")
    return np.uint64(value)


def _array(name: str, arr, dtype, min_size: int):
    import cupy

    if not isinstance(arr, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(arr).__name__}")
    if arr.dtype != dtype or not arr.flags.c_contiguous or arr.size < min_size:
        raise ValueError(f"{name} must be a contiguous {np.dtype(dtype).name} array of at least "
                         f"{min_size} elements, got {arr.dtype} shape {arr.shape} "
                         f"contiguous={arr.flags.c_contiguous}")
    return arr


def _dtype(value) -> int:
    if value not in (0, 1, 2):
        raise ValueError(f"dtype_code must be one of {sorted(DTYPE_CODES.values())}, got {value!r}")
    return int(value)


def _row_grid(num_rows: int, max_blocks: int) -> int:
    return max(1, min(-(-num_rows // ROWS_PER_BLOCK), max_blocks))


@dataclass(frozen=True)
class LaunchSpec:
    """A checked launch: kernel, grid, block, dynamic shared memory and named arguments.

    ``launch(stream)`` runs it through CuPy; :class:`PackedLaunch` packs it once for repeated
    launches where only a few arguments change.
    """

    kernel: object  # cupy.RawKernel
    grid: int
    block: int
    shared_mem: int
    names: tuple
    args: tuple

    def launch(self, stream=None) -> None:
        if stream is None:
            self.kernel((self.grid,), (self.block,), self.args, shared_mem=self.shared_mem)
        else:
            with stream:
                self.kernel((self.grid,), (self.block,), self.args, shared_mem=self.shared_mem)


def _spec(kernel, grid: int, block: int, args: dict, shared_mem: int = 0) -> LaunchSpec:
    return LaunchSpec(kernel, int(grid), int(block), int(shared_mem), tuple(args), tuple(args.values()))


class PackedLaunch:
    """A :class:`LaunchSpec` packed once into a ``cuLaunchKernel`` parameter block.

    The hot paths of the cuda backend launch the same kernels with the same buffers over and
    over; only a few scalars and pointers change (token count, hidden pointer, layer, seq).
    The wrappers' checks run once, when the spec is built; after that ``set(name, value)``
    rewrites one argument in place and ``launch(stream_ptr, grid)`` is one driver call.

    NOTE: ``set`` does not validate: pass only what the spec's wrapper accepts for that
    argument (pointers as ``int`` addresses, counts within the buffers the spec was checked
    against). CUDA copies the parameter block at launch, so it can be rewritten right after.
    """

    _CTYPES = {np.int32: "c_int32", np.int64: "c_int64", np.uint64: "c_uint64",
               np.uint32: "c_uint32", np.float32: "c_float"}

    def __init__(self, spec: LaunchSpec):
        import ctypes

        import cupy

        self.spec = spec
        self.grid, self.block, self.shared_mem = spec.grid, spec.block, spec.shared_mem
        self.function_ptr = int(spec.kernel.kernel.ptr)
        self._slots = {}
        cells = []
        for name, value in zip(spec.names, spec.args):
            if isinstance(value, cupy.ndarray):
                cell = ctypes.c_uint64(value.data.ptr)  # device pointer parameter
            else:
                ctype = self._CTYPES.get(type(value))
                if ctype is None:
                    raise TypeError(f"argument {name} has type {type(value).__name__}; expected a "
                                    f"cupy array or one of {sorted(t.__name__ for t in self._CTYPES)}")
                cell = getattr(ctypes, ctype)(value.item())
            cells.append(cell)
            self._slots[name] = cell
        self._cells = cells
        self._params = (ctypes.c_void_p * max(1, len(cells)))(*[ctypes.addressof(c) for c in cells])
        self.params_ptr = ctypes.addressof(self._params)
        self._launch_kernel = cupy.cuda.driver.launchKernel

    def set(self, name: str, value) -> None:
        """Rewrite argument ``name`` (an address as ``int`` for pointer arguments)."""
        self._slots[name].value = value

    def get(self, name: str):
        return self._slots[name].value

    def launch(self, stream_ptr: int, grid: int | None = None) -> None:
        """Launch on the raw stream handle ``stream_ptr`` with ``grid`` blocks (default: the spec's)."""
        self._launch_kernel(self.function_ptr, self.grid if grid is None else grid, 1, 1,
                            self.block, 1, 1, self.shared_mem, stream_ptr, self.params_ptr, 0)


# --- launch wrappers ---------------------------------------------------------------------------
def dispatch_plan_spec(*, topk_ids, num_partials, num_ffn_ranks, expert_per_rank, routed_cap,
                       chunk_hist, local_rank, expert_counts, expert_start, rank_offsets,
                       done_counter, status_ptr) -> LaunchSpec:
    """Device routing plan of ``num_partials = T * K`` flat partials (afd_dispatch_plan).

    ``topk_ids`` int32 [NK] (flat ``t*K+k``); scratch int32 ``chunk_hist`` [chunks, E] (after:
    per-chunk bases), ``local_rank`` [NK]; outputs int32 ``expert_counts``/``expert_start`` [E],
    ``rank_offsets`` [F+1]; ``done_counter`` uint32 [1]; ``status_ptr`` status block.
    Latches STATUS_CAPACITY (peer, count, cap) if a rank gets more than ``routed_cap`` partials,
    STATUS_BAD_EXPERT on an id outside [0, E). Safe in CUDA graph capture.
    Grid: :func:`dispatch_num_chunks` (num_partials) blocks, at least 1.
    """
    num_partials = _count("num_partials", num_partials)
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)
    epr = _count("expert_per_rank", expert_per_rank, low=1)
    num_experts = int(num_ffn) * int(epr)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_ffn_ranks * expert_per_rank = {num_experts} > {MAX_EXPERTS}")
    num_chunks = dispatch_num_chunks(num_partials)
    args = {"topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "num_partials": num_partials, "num_experts": np.int32(num_experts),
            "expert_per_rank": epr, "num_ffn_ranks": num_ffn,
            "routed_cap": _count("routed_cap", routed_cap),
            "chunk_hist": _array("chunk_hist", chunk_hist, np.int32, num_chunks * num_experts),
            "local_rank": _array("local_rank", local_rank, np.int32, num_partials),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, int(num_ffn) + 1),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1),
            "status_ptr": _address("status_ptr", status_ptr)}
    return _spec(get_kernel("dispatch.cu", "afd_dispatch_plan"), max(1, num_chunks), CHUNK, args,
                 shared_mem=4 * num_experts)


def launch_dispatch_plan(*, stream=None, **kwargs) -> None:
    """Check and launch :func:`dispatch_plan_spec` on ``stream`` (default: the current one)."""
    dispatch_plan_spec(**kwargs).launch(stream)


def dispatch_scatter_spec(*, dtype_code, hidden_ptr, num_tokens, hidden_size, topk_ids,
                          num_partials, top_k, expert_per_rank, num_ffn_ranks, chunk_hist,
                          local_rank, expert_start, rank_offsets, expert_counts, peer_windows,
                          slot_offset, flags_index, off_header, off_route, off_routed_x,
                          off_shared_idx, off_shared_x, hdr_words, has_shared, pos_out,
                          src_rank, layer_idx, stage_idx, hdr_flags, seq_counters, expected,
                          done_counter, status_ptr, always_send=0,
                          max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Write every non-empty FFN rank's message, flags last (afd_dispatch_scatter<DT>).

    ``hidden_ptr``: payload [T, H] row-major; plan arrays from :func:`launch_dispatch_plan`;
    ``peer_windows`` uint64 [F] (device) base address of each FFN rank's window as mapped here;
    ``slot_offset``/``flags_index`` of (region = own Attention rank, ring); field offsets from
    :func:`layout_kernel_args`. Outputs: ``pos_out`` int32 [NK] (row of each partial in its
    destination's segment), ``expected`` int64 [F] (seq sent to each rank, 0 = not sent);
    ``seq_counters`` int64 [F] (this ring's row) is incremented for non-empty ranks only, or for
    every rank when ``always_send`` is 1 (header-only messages to empty ranks, for lockstep).
    If the status block holds an error on entry nothing is written to any peer and
    ``expected`` is all 0. Grid: :func:`scatter_grid`.
    """
    num_partials = _count("num_partials", num_partials)
    num_tokens = _count("num_tokens", num_tokens)
    top_k = _count("top_k", top_k, low=1)
    if int(num_partials) != int(num_tokens) * int(top_k):
        raise ValueError(f"num_partials={num_partials} != num_tokens * top_k = "
                         f"{num_tokens} * {top_k}")
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)
    epr = _count("expert_per_rank", expert_per_rank, low=1)
    num_experts = int(num_ffn) * int(epr)
    hdr_words = _count("hdr_words", hdr_words, low=wire.HDR_FIXED_WORDS + int(epr),
                       high=wire.HDR_FIXED_WORDS + int(epr))
    has_shared = _count("has_shared", has_shared, high=1)
    args = {"hidden_ptr": _address("hidden_ptr", hidden_ptr, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "num_partials": num_partials, "top_k": top_k, "expert_per_rank": epr,
            "num_ffn_ranks": num_ffn,
            "chunk_hist": _array("chunk_hist", chunk_hist, np.int32,
                                 dispatch_num_chunks(num_partials) * num_experts),
            "local_rank": _array("local_rank", local_rank, np.int32, num_partials),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, int(num_ffn) + 1),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "peer_windows": _array("peer_windows", peer_windows, np.uint64, int(num_ffn)),
            "slot_offset": _i64("slot_offset", slot_offset, low=0),
            "flags_index": _count("flags_index", flags_index),
            "off_header": _i64("off_header", off_header, low=0),
            "off_route": _i64("off_route", off_route, low=0),
            "off_routed_x": _i64("off_routed_x", off_routed_x, low=0),
            "off_shared_idx": _i64("off_shared_idx", off_shared_idx, low=0),
            "off_shared_x": _i64("off_shared_x", off_shared_x, low=0),
            "hdr_words": hdr_words, "has_shared": has_shared,
            "always_send": _count("always_send", always_send, high=1),
            "pos_out": _array("pos_out", pos_out, np.int32, num_partials),
            "src_rank": _count("src_rank", src_rank), "layer_idx": np.int32(layer_idx),
            "stage_idx": np.int32(stage_idx), "hdr_flags": np.int32(hdr_flags),
            "seq_counters": _array("seq_counters", seq_counters, np.int64, int(num_ffn)),
            "expected": _array("expected", expected, np.int64, int(num_ffn)),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1),
            "status_ptr": _address("status_ptr", status_ptr)}
    kernel = get_kernel("dispatch.cu", "afd_dispatch_scatter", dtype_code=_dtype(dtype_code))
    return _spec(kernel, scatter_grid(int(num_tokens), int(top_k), int(has_shared), max_blocks), 256, args)


def scatter_grid(num_tokens: int, top_k: int, has_shared: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dispatch_scatter: one warp per routed partial and per shared row."""
    return _row_grid(num_tokens * top_k + (num_tokens if has_shared else 0), max_blocks)


def launch_dispatch_scatter(*, stream=None, **kwargs) -> None:
    """Check and launch :func:`dispatch_scatter_spec` on ``stream`` (default: the current one)."""
    dispatch_scatter_spec(**kwargs).launch(stream)


def combine_spec(*, dtype_code, out_ptr, num_tokens, hidden_size, topk_ids, topk_weights, pos,
                 top_k, expert_per_rank, num_ffn_ranks, has_shared, window_ptr, flags_bytes,
                 slot_bytes, ring_depth, ring, off_header, off_routed_x, off_shared_x, hdr_words,
                 expected, last_seen, timeout_ns, out_scale, done_counter, status_ptr,
                 max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Wait for the replies of every rank with ``expected[j] != 0``, then combine (afd_combine<DT>).

    ``out_ptr``: payload [T, H]; ``topk_ids`` int32 [T*K]; ``topk_weights`` float32 [T*K];
    ``pos`` int32 [T*K] (``pos_out`` of the scatter); ``window_ptr``: this rank's own window;
    ``expected`` int64 [F]; ``last_seen`` int64 [num_regions * ring_depth] (device, updated on
    success). Bounded by ``timeout_ns``; errors (TIMEOUT, BAD_HEADER, SHUTDOWN, ECHO_MISMATCH)
    are latched in the status block and the output rows are NaN. Grid: :func:`combine_grid`.
    """
    num_tokens = _count("num_tokens", num_tokens)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1)
    ring_depth = _count("ring_depth", ring_depth, low=1)
    num_partials = int(num_tokens) * int(top_k)
    args = {"out_ptr": _address("out_ptr", out_ptr, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "topk_weights": _array("topk_weights", topk_weights, np.float32, num_partials),
            "pos": _array("pos", pos, np.int32, num_partials), "top_k": top_k,
            "expert_per_rank": _count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": num_ffn, "has_shared": _count("has_shared", has_shared, high=1),
            "window_ptr": _address("window_ptr", window_ptr),
            "flags_bytes": _i64("flags_bytes", flags_bytes, low=0),
            "slot_bytes": _i64("slot_bytes", slot_bytes, low=0), "ring_depth": ring_depth,
            "ring": _count("ring", ring, high=int(ring_depth) - 1),
            "off_header": _i64("off_header", off_header, low=0),
            "off_routed_x": _i64("off_routed_x", off_routed_x, low=0),
            "off_shared_x": _i64("off_shared_x", off_shared_x, low=0),
            "hdr_words": _count("hdr_words", hdr_words, low=wire.HDR_FIXED_WORDS),
            "expected": _array("expected", expected, np.int64, int(num_ffn)),
            "last_seen": _array("last_seen", last_seen, np.int64, int(num_ffn) * int(ring_depth)),
            "timeout_ns": _i64("timeout_ns", timeout_ns, low=0), "out_scale": np.float32(out_scale),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1),
            "status_ptr": _address("status_ptr", status_ptr)}
    kernel = get_kernel("combine.cu", "afd_combine", dtype_code=_dtype(dtype_code))
    return _spec(kernel, combine_grid(int(num_tokens), max_blocks), 256, args)


def combine_grid(num_tokens: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_combine: one per token, at most ``max_blocks``, at least 1."""
    return max(1, min(num_tokens, max_blocks))


def launch_combine(*, stream=None, **kwargs) -> None:
    """Check and launch :func:`combine_spec` on ``stream`` (default: the current one)."""
    combine_spec(**kwargs).launch(stream)


def wait_replies_spec(*, window_ptr, num_ffn_ranks, flags_bytes, slot_bytes, ring_depth, ring,
                      off_header, expected, last_seen, timeout_ns, status_ptr) -> LaunchSpec:
    """One-block spin until every rank with ``expected[j] != 0`` replied (afd_wait_replies).

    Launch right before :func:`launch_combine` on the same stream with the same arguments:
    only this kernel spins, so a large combine never holds every SM while it waits. Errors
    (TIMEOUT, BAD_HEADER, SHUTDOWN, ECHO_MISMATCH) are latched in the status block;
    ``last_seen`` is read only (the combine updates it).
    """
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1)
    ring_depth = _count("ring_depth", ring_depth, low=1)
    args = {"window_ptr": _address("window_ptr", window_ptr), "num_ffn_ranks": num_ffn,
            "flags_bytes": _i64("flags_bytes", flags_bytes, low=0),
            "slot_bytes": _i64("slot_bytes", slot_bytes, low=0), "ring_depth": ring_depth,
            "ring": _count("ring", ring, high=int(ring_depth) - 1),
            "off_header": _i64("off_header", off_header, low=0),
            "expected": _array("expected", expected, np.int64, int(num_ffn)),
            "last_seen": _array("last_seen", last_seen, np.int64, int(num_ffn) * int(ring_depth)),
            "timeout_ns": _i64("timeout_ns", timeout_ns, low=0),
            "status_ptr": _address("status_ptr", status_ptr)}
    return _spec(get_kernel("combine.cu", "afd_wait_replies"), 1, 32, args)


def launch_wait_replies(*, stream=None, **kwargs) -> None:
    """Check and launch :func:`wait_replies_spec` on ``stream`` (default: the current one)."""
    wait_replies_spec(**kwargs).launch(stream)


def wait_any_spec(*, window_ptr, num_slots, last_seen, scan_start, off_header, flags_bytes,
                  slot_bytes, hdr_words, timeout_ns, doorbell_ptr, ticket) -> LaunchSpec:
    """FFN arrival detection over all ``num_slots`` flags of the own window (afd_wait_any).

    ``last_seen`` int64 [num_slots] and ``scan_start`` int32 [1] live on the device and are
    updated on arrival. ``doorbell_ptr``: pinned int64 [DB_HEADER + ceil(hdr_words / 2)]; the
    kernel writes slot, flag, status (STATUS_OK / STATUS_TIMEOUT) and header words, then
    ``ticket`` into word DB_TICKET last: the host spins on that word. One block, one warp.
    """
    num_slots = _count("num_slots", num_slots, low=1)
    args = {"window_ptr": _address("window_ptr", window_ptr), "num_slots": num_slots,
            "last_seen": _array("last_seen", last_seen, np.int64, int(num_slots)),
            "scan_start": _array("scan_start", scan_start, np.int32, 1),
            "off_header": _i64("off_header", off_header, low=0),
            "flags_bytes": _i64("flags_bytes", flags_bytes, low=0),
            "slot_bytes": _i64("slot_bytes", slot_bytes, low=0),
            "hdr_words": _count("hdr_words", hdr_words, low=wire.HDR_FIXED_WORDS),
            "timeout_ns": _i64("timeout_ns", timeout_ns, low=0),
            "doorbell_ptr": _address("doorbell_ptr", doorbell_ptr), "ticket": np.int64(ticket)}
    return _spec(get_kernel("wait_any.cu", "afd_wait_any"), 1, 32, args)


def launch_wait_any(*, stream=None, **kwargs) -> None:
    """Check and launch :func:`wait_any_spec` on ``stream`` (default: the current one)."""
    wait_any_spec(**kwargs).launch(stream)


def reply_spec(*, dtype_code, dst_window_ptr, slot_offset, flags_index, off_header, off_routed_x,
               off_shared_x, routed_out_ptr, num_routed, shared_out_ptr, num_shared, hidden_size,
               header_src_ptr, hdr_words, seq, done_counter, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Write ``num_routed`` + ``num_shared`` output rows, then header and flag = ``seq``, into
    slot (region = own FFN rank, ring) of an Attention peer's window (afd_reply<DT>).

    ``routed_out_ptr`` / ``shared_out_ptr``: payload [R, H] / [S, H] (may be 0 when the count
    is 0); ``header_src_ptr``: pinned int32 [hdr_words] prepared by the host; it must stay
    unchanged until the kernel has run (one buffer per in-flight reply). Grid:
    :func:`reply_grid`.
    """
    num_routed = _count("num_routed", num_routed)
    num_shared = _count("num_shared", num_shared)
    args = {"dst_window_ptr": _address("dst_window_ptr", dst_window_ptr),
            "slot_offset": _i64("slot_offset", slot_offset, low=0),
            "flags_index": _count("flags_index", flags_index),
            "off_header": _i64("off_header", off_header, low=0),
            "off_routed_x": _i64("off_routed_x", off_routed_x, low=0),
            "off_shared_x": _i64("off_shared_x", off_shared_x, low=0),
            "routed_out_ptr": _address("routed_out_ptr", routed_out_ptr, allow_null=num_routed == 0),
            "num_routed": num_routed,
            "shared_out_ptr": _address("shared_out_ptr", shared_out_ptr, allow_null=num_shared == 0),
            "num_shared": num_shared, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "header_src_ptr": _address("header_src_ptr", header_src_ptr),
            "hdr_words": _count("hdr_words", hdr_words, low=wire.HDR_FIXED_WORDS),
            "seq": np.int64(seq), "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("reply.cu", "afd_reply", dtype_code=_dtype(dtype_code))
    return _spec(kernel, reply_grid(int(num_routed) + int(num_shared), max_blocks), 256, args)


def reply_grid(num_rows: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_reply: one warp per output row, at least 1."""
    return _row_grid(num_rows, max_blocks)


def launch_reply(*, stream=None, **kwargs) -> None:
    """Check and launch :func:`reply_spec` on ``stream`` (default: the current one)."""
    reply_spec(**kwargs).launch(stream)


def read_wire_constants() -> dict:
    """name -> value of the constants compiled into the kernels (synchronizes)."""
    import cupy

    out = cupy.full(len(WIRE_CONSTANT_NAMES), -12345, dtype=cupy.int64)
    get_kernel("wire_constants.cu", "afd_read_wire_constants")((1,), (1,), (out,))
    return dict(zip(WIRE_CONSTANT_NAMES, (int(v) for v in out.get())))
