"""Compile every registered kernel file with NVRTC, without a GPU (docs/design/kernels.md).

The loader (``afd_cupy.kernels.loader``) compiles ``raw_kernels/*.cu`` through CuPy on the
device. This tool runs the same NVRTC compile (same options, same name expressions, every
payload dtype instantiation) through ctypes on any machine where ``libnvrtc`` can be found, so
that a kernel edit is compile-checked before it costs device time:

    pip install nvidia-cuda-nvrtc          # CUDA 13 NVRTC, ~140 MB, no driver needed
    python tools/nvrtc_check.py [--arch compute_90] [FILE.cu ...]

It prints one line per file and exits non-zero if any compile failed (with NVRTC's log).

A refactor check without a GPU: ``--ptx-summary OUT.json`` writes, per file and kernel (name
expression), how often each PTX instruction (opcode with its modifiers) occurs;
``--compare BEFORE.json`` prints every kernel whose counts differ from an earlier summary
(e.g. written before the change, from a stash or another worktree) and exits 1 if any does::

    python tools/nvrtc_check.py --ptx-summary /tmp/before.json      # on the old tree
    python tools/nvrtc_check.py --ptx-summary /tmp/after.json --compare /tmp/before.json

Equal counts do not prove equal behaviour (order and operands are not compared), but a
change in the number of loads, stores, fences or atomics of a kernel is always visible.
Finding libnvrtc: ``$AFD_NVRTC_LIB``, else the ``nvidia`` wheels' lib directories, else the
system loader path.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from afd_cupy.kernels import loader  # noqa: E402  (does not import CuPy)

NVRTC_SUCCESS = 0


def find_nvrtc() -> str | None:
    """Path (or soname) of a loadable libnvrtc, or None."""
    explicit = os.environ.get("AFD_NVRTC_LIB")
    if explicit:
        return explicit
    candidates = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            candidates.extend(sorted(glob.glob(os.path.join(entry, sub, "libnvrtc.so.*"))))
    candidates = [c for c in candidates if "builtins" not in c]
    candidates += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for candidate in candidates:
        try:
            ctypes.CDLL(candidate)
            return candidate
        except OSError:
            continue
    return None


class Nvrtc:
    """The few NVRTC entry points a compile check needs."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, what: str) -> None:
        if result != NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, name: str, options, name_expressions, *,
                want_ptx: bool = False) -> tuple[bool, str]:
        """(ok, log) of compiling ``source`` with ``options`` and ``name_expressions``; with
        ``want_ptx``, (ok, log, ptx, {lowered name: name expression}) (ptx "" on failure)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            for expr in name_expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()),
                            f"nvrtcAddNameExpression({expr})")
            opts = [o.encode() for o in options]
            argv = (ctypes.c_char_p * len(opts))(*opts)
            result = self.lib.nvrtcCompileProgram(prog, len(opts), argv)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(prog, buf), "log")
            log = buf.value.decode(errors="replace").strip()
            names, ptx = {}, ""
            if result == NVRTC_SUCCESS:
                for expr in name_expressions:  # every expression must resolve to a symbol
                    lowered = ctypes.c_char_p()
                    self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(),
                                                             ctypes.byref(lowered)),
                                f"nvrtcGetLoweredName({expr})")
                    names[lowered.value.decode()] = expr
                if want_ptx:
                    self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
                    code = ctypes.create_string_buffer(size.value)
                    self._check(self.lib.nvrtcGetPTX(prog, code), "PTX")
                    ptx = code.value.decode(errors="replace")
            if want_ptx:
                return result == NVRTC_SUCCESS, log, ptx, names
            return result == NVRTC_SUCCESS, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


_ENTRY = re.compile(r"^\s*(?:\.\w+\s+)*\.entry\s+([A-Za-z_$][\w$]*)")  # .visible / .weak


def ptx_opcode_counts(ptx: str) -> dict[str, dict[str, int]]:
    """{kernel symbol: {opcode with modifiers: count}} of the ``.entry`` functions of ``ptx``
    (a predicate ``@%p1`` / ``@!%p1`` is skipped; directives, labels and comments are not
    instructions)."""
    kernels: dict[str, collections.Counter] = {}
    current, depth = None, 0
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip()
        match = _ENTRY.match(line)
        if match:
            current, depth = match.group(1), 0
            kernels[current] = collections.Counter()
            continue
        if current is None or not line:
            continue
        depth += line.count("{") - line.count("}")
        if line.startswith("}") and depth <= 0:
            current = None
            continue
        tokens = line.rstrip(";").replace("{", " ").replace("}", " ").split()
        if tokens and tokens[0].startswith("@"):
            tokens = tokens[1:]
        if not tokens or not tokens[0][0].isalpha() or tokens[0].endswith(":"):
            continue  # directives (.reg), registers, labels, the parameter list's ")"
        kernels[current][tokens[0].rstrip(",")] += 1
    return {name: dict(sorted(counts.items())) for name, counts in kernels.items()}


def compare_summaries(before: dict, after: dict) -> list[str]:
    """One line per kernel (``file: kernel``) whose opcode counts differ, or that exists in
    only one summary, with the differing opcodes as ``opcode before->after``."""
    lines = []
    for filename in sorted(set(before) | set(after)):
        old, new = before.get(filename, {}), after.get(filename, {})
        for kernel in sorted(set(old) | set(new)):
            if kernel not in old or kernel not in new:
                lines.append(f"{filename}: {kernel} only {'after' if kernel in new else 'before'}")
                continue
            a, b = old[kernel], new[kernel]
            diffs = [f"{op} {a.get(op, 0)}->{b.get(op, 0)}" for op in sorted(set(a) | set(b))
                     if a.get(op, 0) != b.get(op, 0)]
            if diffs:
                lines.append(f"{filename}: {kernel}: " + ", ".join(diffs))
    return lines


def registered_files() -> list[str]:
    return sorted(loader.FILE_KERNELS) + sorted(loader.PROBE_KERNELS)


def check_file(nvrtc: Nvrtc, filename: str, arch: str, *, want_ptx: bool = False):
    """NVRTC's (ok, log) for one kernel file (with ``want_ptx``: also the PTX and the
    lowered names, :meth:`Nvrtc.compile`)."""
    path = loader.kernel_path(filename)
    # NOTE: the source key changes with every edit; a fixed one keeps PTX comparable
    key = "0" * 16 if want_ptx else loader.source_key(path)
    options = loader.BASE_OPTIONS + (f"-I{loader.KERNEL_DIR}", f"-I{path.parent}",
                                     f"-DAFD_SOURCE_KEY=0x{key[:16]}", f"--gpu-architecture={arch}")
    return nvrtc.compile(path.read_text(), path.name, options,
                         loader.kernel_name_expressions(filename), want_ptx=want_ptx)


def file_summary(ptx: str, names: dict) -> dict:
    """Opcode counts per kernel of one file, keyed by name expression where one lowers to it."""
    return {names.get(symbol, symbol): counts for symbol, counts in ptx_opcode_counts(ptx).items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="kernel files relative to raw_kernels/ "
                        "(default: every registered file)")
    parser.add_argument("--arch", default="compute_90", help="NVRTC --gpu-architecture")
    parser.add_argument("--ptx-summary", metavar="OUT.json",
                        help="write PTX opcode counts per kernel (module doc)")
    parser.add_argument("--compare", metavar="BEFORE.json",
                        help="with --ptx-summary: print the kernels whose counts differ; exit 1 if any")
    args = parser.parse_args(argv)
    if args.compare and not args.ptx_summary:
        parser.error("--compare needs --ptx-summary")
    lib = find_nvrtc()
    if lib is None:
        print("nvrtc_check: no libnvrtc found (pip install nvidia-cuda-nvrtc, or set "
              "AFD_NVRTC_LIB)", file=sys.stderr)
        return 2
    nvrtc = Nvrtc(lib)
    failed, summary = 0, {}
    for filename in args.files or registered_files():
        if args.ptx_summary:
            ok, log, ptx, names = check_file(nvrtc, filename, args.arch, want_ptx=True)
            summary[filename] = file_summary(ptx, names) if ok else {}
        else:
            ok, log = check_file(nvrtc, filename, args.arch)
        exprs = loader.kernel_name_expressions(filename)
        print(f"{'OK  ' if ok else 'FAIL'} {filename} ({len(exprs)} kernels, NVRTC "
              f"{nvrtc.version[0]}.{nvrtc.version[1]}, {args.arch})")
        if log and (not ok or "warning" in log):
            print(log)
        failed += not ok
    if args.ptx_summary:
        Path(args.ptx_summary).write_text(json.dumps(summary, indent=1, sort_keys=True))
        print(f"wrote {args.ptx_summary} ({sum(len(k) for k in summary.values())} kernels)")
    if args.compare:
        diffs = compare_summaries(json.loads(Path(args.compare).read_text()), summary)
        print("\n".join(diffs) if diffs else f"PTX opcode counts equal to {args.compare}")
        failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
