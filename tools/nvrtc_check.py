"""Compile every registered kernel file with NVRTC, without a GPU (docs/design.md §5).

The loader (``afd_cupy.kernels.loader``) compiles ``raw_kernels/*.cu`` through CuPy on the
device. This tool runs the same NVRTC compile (same options, same name expressions, every
payload dtype instantiation) through ctypes on any machine where ``libnvrtc`` can be found, so
that a kernel edit is compile-checked before it costs device time:

    pip install nvidia-cuda-nvrtc          # CUDA 13 NVRTC, ~140 MB, no driver needed
    python tools/nvrtc_check.py [--arch compute_90] [FILE.cu ...]

It prints one line per file and exits non-zero if any compile failed (with NVRTC's log).
Finding libnvrtc: ``$AFD_NVRTC_LIB``, else the ``nvidia`` wheels' lib directories, else the
system loader path.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
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

    def compile(self, source: str, name: str, options, name_expressions) -> tuple[bool, str]:
        """(ok, log) of compiling ``source`` with ``options`` and ``name_expressions``."""
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
            if result == NVRTC_SUCCESS:
                for expr in name_expressions:  # every expression must resolve to a symbol
                    lowered = ctypes.c_char_p()
                    self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(),
                                                             ctypes.byref(lowered)),
                                f"nvrtcGetLoweredName({expr})")
            return result == NVRTC_SUCCESS, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def registered_files() -> list[str]:
    return sorted(loader.FILE_KERNELS) + sorted(loader.PROBE_KERNELS)


def check_file(nvrtc: Nvrtc, filename: str, arch: str) -> tuple[bool, str]:
    path = loader.kernel_path(filename)
    key = loader.source_key(path)
    options = loader.BASE_OPTIONS + (f"-I{loader.KERNEL_DIR}", f"-I{path.parent}",
                                     f"-DAFD_SOURCE_KEY=0x{key[:16]}", f"--gpu-architecture={arch}")
    return nvrtc.compile(path.read_text(), path.name, options,
                         loader.kernel_name_expressions(filename))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="kernel files relative to raw_kernels/ "
                        "(default: every registered file)")
    parser.add_argument("--arch", default="compute_90", help="NVRTC --gpu-architecture")
    args = parser.parse_args(argv)
    lib = find_nvrtc()
    if lib is None:
        print("nvrtc_check: no libnvrtc found (pip install nvidia-cuda-nvrtc, or set "
              "AFD_NVRTC_LIB)", file=sys.stderr)
        return 2
    nvrtc = Nvrtc(lib)
    failed = 0
    for filename in args.files or registered_files():
        ok, log = check_file(nvrtc, filename, args.arch)
        exprs = loader.kernel_name_expressions(filename)
        print(f"{'OK  ' if ok else 'FAIL'} {filename} ({len(exprs)} kernels, NVRTC "
              f"{nvrtc.version[0]}.{nvrtc.version[1]}, {args.arch})")
        if log and (not ok or "warning" in log):
            print(log)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
