"""Every registered kernel file compiles with NVRTC (no GPU needed; skips without libnvrtc).

CI installs ``nvidia-cuda-nvrtc`` so that a kernel that does not compile fails on a CPU
machine, before it costs device time (``tools/nvrtc_check.py``).
"""
import importlib.util

import pytest

from helpers.paths import TOOLS_DIR

_TOOL = TOOLS_DIR / "nvrtc_check.py"
_spec = importlib.util.spec_from_file_location("nvrtc_check", _TOOL)
nvrtc_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nvrtc_check)

_LIB = nvrtc_check.find_nvrtc()
needs_nvrtc = pytest.mark.skipif(_LIB is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc)")


@needs_nvrtc
@pytest.mark.parametrize("filename", nvrtc_check.registered_files())
def test_kernel_file_compiles(filename):
    ok, log = nvrtc_check.check_file(nvrtc_check.Nvrtc(_LIB), filename, "compute_90")
    assert ok, f"{filename} does not compile:\n{log}"
    assert "warning" not in log, log


@needs_nvrtc
def test_a_broken_kernel_fails_with_its_log():
    nvrtc = nvrtc_check.Nvrtc(_LIB)
    good = 'extern "C" __global__ void k(int* p) { p[0] = 1; }'
    assert nvrtc.compile(good, "good.cu", ("--gpu-architecture=compute_90",), ("k",))[0]
    ok, log = nvrtc.compile(good.replace("p[0] = 1;", "p[0] = undefined_name;"), "bad.cu",
                            ("--gpu-architecture=compute_90",), ("k",))
    assert not ok and "undefined_name" in log


_PTX = """
.version 9.5
.weak .entry _Z1kILi0EEvPi(
	.param .u64 _Z1kILi0EEvPi_param_0
)
{
	.reg .pred 	%p<2>;
	.reg .b64 	%rd<3>;
	ld.param.u64 	%rd1, [_Z1kILi0EEvPi_param_0];   // a comment: st.global.u32 is not counted here
	cvta.to.global.u64 	%rd2, %rd1;
$L__BB0_1:
	@%p1 bra 	$L__BB0_1;
	st.global.u32 	[%rd2], 1;
	st.global.u32 	[%rd2+4], 2;
	fence.sc.sys;
	ret;
}
.visible .entry other()
{
	ret;
}
"""


def test_ptx_opcode_counts_per_entry():
    counts = nvrtc_check.ptx_opcode_counts(_PTX)
    assert counts == {"_Z1kILi0EEvPi": {"bra": 1, "cvta.to.global.u64": 1, "fence.sc.sys": 1,
                                        "ld.param.u64": 1, "ret": 1, "st.global.u32": 2},
                      "other": {"ret": 1}}


def test_compare_summaries_names_each_changed_kernel_and_opcode():
    before = {"a.cu": {"k<0>": {"st.global.u32": 2, "ret": 1}, "gone": {"ret": 1}}}
    after = {"a.cu": {"k<0>": {"st.global.u32": 3, "ret": 1}, "new": {"ret": 1}}, "b.cu": {}}
    assert nvrtc_check.compare_summaries(before, after) == [
        "a.cu: gone only before", "a.cu: k<0>: st.global.u32 2->3", "a.cu: new only after"]
    assert nvrtc_check.compare_summaries(after, after) == []


@needs_nvrtc
def test_ptx_summary_of_a_kernel_file_names_its_instantiations(tmp_path):
    out = tmp_path / "summary.json"
    assert nvrtc_check.main(["ffn/reply.cu", "--ptx-summary", str(out)]) == 0
    assert nvrtc_check.main(["ffn/reply.cu", "--ptx-summary", str(tmp_path / "again.json"),
                             "--compare", str(out)]) == 0  # the same tree: equal counts
    import json
    summary = json.loads(out.read_text())["ffn/reply.cu"]
    assert sorted(summary) == ["afd_reply<0>", "afd_reply<1>", "afd_reply<2>"]
    for counts in summary.values():  # the reply stores rows, fences at system scope, sets a flag
        assert counts.get("fence.acq_rel.sys", 0) >= 1, counts  # the release (wire.cuh fence_release_sys)
        assert counts.get("membar.sys", 0) == 0, counts  # no sequentially consistent fence
        assert counts.get("st.volatile.global.u64", 0) >= 1, counts  # the flag store
        assert counts.get("st.global.v4.u32", 0) >= 1, counts  # 16-byte row stores
