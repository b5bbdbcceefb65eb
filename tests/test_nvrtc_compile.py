"""Every registered kernel file compiles with NVRTC (no GPU needed; skips without libnvrtc).

CI installs ``nvidia-cuda-nvrtc`` so that a kernel that does not compile fails on a CPU
machine, before it costs device time (``tools/nvrtc_check.py``).
"""
import importlib.util
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parent.parent / "tools" / "nvrtc_check.py"
_spec = importlib.util.spec_from_file_location("nvrtc_check", _TOOL)
nvrtc_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nvrtc_check)

_LIB = nvrtc_check.find_nvrtc()
pytestmark = pytest.mark.skipif(_LIB is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc)")


@pytest.mark.parametrize("filename", nvrtc_check.registered_files())
def test_kernel_file_compiles(filename):
    ok, log = nvrtc_check.check_file(nvrtc_check.Nvrtc(_LIB), filename, "compute_90")
    assert ok, f"{filename} does not compile:\n{log}"
    assert "warning" not in log, log


def test_a_broken_kernel_fails_with_its_log():
    nvrtc = nvrtc_check.Nvrtc(_LIB)
    good = 'extern "C" __global__ void k(int* p) { p[0] = 1; }'
    assert nvrtc.compile(good, "good.cu", ("--gpu-architecture=compute_90",), ("k",))[0]
    ok, log = nvrtc.compile(good.replace("p[0] = 1;", "p[0] = undefined_name;"), "bad.cu",
                            ("--gpu-architecture=compute_90",), ("k",))
    assert not ok and "undefined_name" in log
