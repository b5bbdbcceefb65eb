"""Weight-streaming grouped GEMMs for the routed experts (Triton): a candidate decode path of
issue #34, timed by ``tools/bench_moe_layer.py`` as the ``stream`` and ``stream_fp8`` variants of
:mod:`afd_cupy.moe.expert_gemm`. It changes no default (``moe.grouped_mlp`` is unchanged).

At decode an FFN rank's experts get a few rows each (128 tokens x top-6 over 64 experts: ~12),
so their GEMMs are bound by reading the weights, and what matters is how many bytes are in
flight, not tensor-core tiles. Each program here owns one expert and one tile of ``BLOCK_N``
output channels: it streams that tile of the weights once along K (``BLOCK_K`` at a time) and
multiplies it with all of the expert's rows (``BLOCK_M`` at a time; an expert with more rows
than ``BLOCK_M`` streams its tile again per row tile, which the L2 mostly serves). The grid is
(output tiles, experts); an expert without rows costs one empty program. The first GEMM
computes the gate and the up tile of the same channels in one program and applies
``silu(gate) * up`` in fp32 before its one rounding (the other activations: the gate/up GEMM
rounded to the rows' dtype, then ``moe.act_and_mul``, then the down GEMM).

FP8 weights (``moe.FP8ExpertWeights``: E4M3 with one fp32 scale per output channel) are read
as E4M3 (half the bytes) and widened to the rows' dtype in registers; the channel's scale
multiplies the fp32 sum (it is constant along K). The rows stay in their dtype: no activation
quantization, unlike ``moe.grouped_mlp``'s FP8 path (docs/design/fp8.md).

No host synchronization, no host-to-device copy: each program reads its expert's rows from the
groups' cumulative end rows on the device (``torch._grouped_mm``'s ``offs``; from
``group_counts`` one ``torch.cumsum``), so a CUDA graph can capture it (compile it by one call
before the capture). On the CPU the same kernel runs in Triton's interpreter (numpy): what the
CPU tests check. Triton ships with torch's CUDA wheels for Linux; where it is missing,
:func:`unavailable_reason` says so.

Shapes and dtypes (:func:`grouped_mlp_streamed`): x [rows, H] bf16/fp16 (fp32 on the CPU), rows
grouped by local expert as ``moe.grouped_mlp`` takes them, any row stride; group_counts int [E]
on x's device; weights contiguous, no biases. Returns [rows, H] in x.dtype.
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass

import torch

from afd_cupy.moe.weights import ExpertWeights, act_and_mul

#: ``triton.language`` once :func:`_triton` imported it (the kernel's global ``tl``)
tl = None

__all__ = ["StreamConfig", "DEFAULT_CONFIG", "unavailable_reason", "grouped_mlp_streamed",
           "stacked_mlp_streamed", "row_block", "compile_check"]


@dataclass(frozen=True)
class StreamConfig:
    """Tile sizes and launch shape: ``block_n`` output channels and ``block_k`` of K per step
    (powers of two >= 16), ``num_warps``, ``num_stages`` (software pipelining depth on the GPU),
    ``block_m`` the rows' tile (a power of two >= 16; None, the default: it follows the rows per
    expert, :func:`row_block`; a large fixed tile suits prefill)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    block_m: int | None = None

    def __post_init__(self):
        for name in ("block_n", "block_k", "block_m"):
            value = getattr(self, name)
            if value is None and name == "block_m":
                continue
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"StreamConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"StreamConfig needs num_warps in (1, 2, 4, 8, 16) and num_stages >= 1, got "
                             f"{self.num_warps}, {self.num_stages}")


DEFAULT_CONFIG = StreamConfig()


def row_block(num_rows: int, num_experts: int) -> int:
    """``BLOCK_M``: twice the mean rows per expert, as a power of two in [16, 64], so that an
    expert's rows fit one tile unless its count is well above the mean."""
    mean = num_rows / max(1, num_experts)
    block = 16
    while block < 64 and block < 2 * mean:
        block *= 2
    return block


def unavailable_reason(device) -> str | None:
    """Why the streamed GEMMs cannot run on ``device`` (None: they can; on the CPU through
    Triton's interpreter, whatever mode Triton was imported in: the kernel uses only Triton's
    builtins; a tiny problem is run there once per process, since some Triton releases'
    interpreters fail on newer numpy). On the GPU, not under ``TRITON_INTERPRET=1`` (which
    makes every Triton kernel of the process an interpreted one)."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return f"device type {device.type} is not supported"
    try:
        _triton()
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if device.type == "cpu":
        return _interpreter_reason()
    if device.type == "cuda":
        if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off"):
            return "TRITON_INTERPRET=1 is set: this process runs Triton's CPU interpreter"
        if not torch.cuda.is_available():
            return "no CUDA device"
        major = torch.cuda.get_device_capability(device)[0]
        if major < 8:
            return f"needs compute capability >= 8.0, the device has {major}.x"
    return None


@functools.lru_cache(maxsize=None)
def _device_reason(device: str) -> str | None:
    """:func:`unavailable_reason` once per device and process (each call of the MLPs asks)."""
    return unavailable_reason(device)


@functools.lru_cache(maxsize=1)
def _interpreter_reason() -> str | None:
    """None when Triton's CPU interpreter runs the kernel (a 16 x 16 problem checked against
    numpy, once per process), else why not: an interpreter of some Triton releases fails on
    newer numpy (Triton 3.6 with numpy 2.4: a loop bound loaded from memory is a 1-element
    array, which numpy no longer converts to an int)."""
    import numpy as np

    triton = _triton()
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16) / 32
    w = torch.arange(256, dtype=torch.float32).reshape(1, 16, 16) / 256
    out = torch.full((2, 16), float("nan"))
    offs = torch.tensor([2], dtype=torch.int32)
    try:
        _kernel(True)[(1, 1)](x, w, out, offs, out, 16, 16, 1, 1, x.stride(0), w.stride(0), w.stride(1), 0,
                              out.stride(0), 0, GLU=False, HAS_SCALE=False, F32_DOT=True, BLOCK_M=16,
                              BLOCK_N=16, BLOCK_K=16)
    except Exception as exc:  # noqa: BLE001 - any failure of the interpreter is the reason
        return (f"Triton {triton.__version__}'s CPU interpreter cannot run the kernel with numpy "
                f"{np.__version__}: {type(exc).__name__}: {str(exc)[:160]}")
    want = x.numpy().astype(np.float64) @ w[0].numpy().astype(np.float64).T
    if not np.allclose(out.numpy(), want, rtol=1e-5, atol=1e-6):
        return f"Triton {triton.__version__}'s CPU interpreter gives wrong results for the kernel"
    return None


def _triton():
    """Import Triton and bind the kernel's ``tl``."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton


# --------------------------------------------------------------------------- the kernel

def _stream_gemm(x_ptr, w_ptr, scale_ptr, offs_ptr, out_ptr, N, K, num_experts, num_layers,
                 stride_xm, stride_we, stride_wn, stride_se, stride_om, up_offset,
                 GLU: tl.constexpr, HAS_SCALE: tl.constexpr, F32_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r, n] = sum_k x[r, k] * w[g, n, k] (* scale[g, n]) for the rows r of each group g of
    this program's expert e = program_id(1), n in its tile: groups g = l * num_experts + e for
    l < num_layers (stacked layers; one layer: g = e), group g's rows [offs[g - 1], offs[g])
    (torch._grouped_mm's cumulative end rows). GLU: also the up channel n + up_offset, and out
    = silu(gate) * up. Accumulates in fp32, rounds once to out's dtype. F32_DOT: both operands
    widened to fp32, IEEE products (the interpreter: its bf16 dot is wrong); else the weights
    widened to the rows' dtype (E4M3 -> bf16 / fp16: exact) and the tensor cores' dot. Only
    Triton's builtins (no function of triton.language.standard): the interpreter runs it even
    where Triton was imported for the GPU."""
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    for layer in range(0, num_layers):
        group = layer * num_experts + expert
        end = tl.load(offs_ptr + group).to(tl.int32)
        start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0).to(tl.int32)
        w_tile = w_ptr + group.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        if HAS_SCALE:
            scale = tl.load(scale_ptr + group * stride_se + cols, mask=col_ok, other=0.0)
            if GLU:
                up_scale = tl.load(scale_ptr + group * stride_se + up_offset + cols, mask=col_ok, other=0.0)
        for row0 in range(start, end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            if GLU:
                acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w_ok = col_ok[:, None] & k_ok[None, :]
                b = tl.load(w_tile + ks[None, :], mask=w_ok, other=0.0)
                if F32_DOT:
                    a = a.to(tl.float32)
                    acc += tl.dot(a, tl.trans(b.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(a, tl.trans(b.to(a.dtype)))
                if GLU:
                    b_up = tl.load(w_tile + up_offset * stride_wn + ks[None, :], mask=w_ok, other=0.0)
                    if F32_DOT:
                        acc_up += tl.dot(a, tl.trans(b_up.to(tl.float32)), input_precision="ieee")
                    else:
                        acc_up += tl.dot(a, tl.trans(b_up.to(a.dtype)))
            if HAS_SCALE:
                acc = acc * scale[None, :]
                if GLU:
                    acc_up = acc_up * up_scale[None, :]
            if GLU:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel compiled for CUDA (``triton.jit``) or for Triton's CPU interpreter."""
    triton = _triton()
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_stream_gemm)
    return triton.jit(_stream_gemm)


# --------------------------------------------------------------------------- the MLP

def grouped_mlp_streamed(x: torch.Tensor, group_counts: torch.Tensor, weights, *,
                         config: StreamConfig = DEFAULT_CONFIG,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts on x [rows, H] -> [rows, H] in x.dtype (module doc): ``weights`` an
    ``ExpertWeights`` of x's dtype or a ``moe.FP8ExpertWeights``, on x's device, no biases.
    ``group_counts`` int [E] on x's device, summing to rows (not checked: that would
    synchronize; rows past the counts' sum are left unwritten). ``out``: [rows, H] x.dtype on
    x's device with unit column stride, written in place and returned (default: a new tensor).
    ValueError for anything else."""
    _check(x, group_counts, weights, "group_counts")
    offs = torch.cumsum(group_counts, dim=0, dtype=torch.int32)
    return _mlp(x, offs, weights, weights.num_experts, config, out)


def stacked_mlp_streamed(x: torch.Tensor, offs: torch.Tensor, weights, *, experts_per_layer: int,
                         config: StreamConfig = DEFAULT_CONFIG,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The graph FFN's form: ``weights`` hold several layers' experts stacked layer-major
    (``num_experts = layers * experts_per_layer``), ``offs`` int32 [num_experts] on x's device
    the cumulative end row of each group (``torch._grouped_mm``'s ``offs``: group g's rows are
    [offs[g - 1], offs[g])). One program per (output tile, expert of a layer) walks its expert
    in every layer, so a replay in which one layer has rows launches what one layer needs. The
    rest as :func:`grouped_mlp_streamed` (rows past offs[-1] are left unwritten)."""
    _check(x, offs, weights, "offs")
    if offs.dtype != torch.int32:
        raise ValueError(f"offs must be int32 (torch._grouped_mm's offsets), got {offs.dtype}")
    if isinstance(experts_per_layer, bool) or not isinstance(experts_per_layer, int) or experts_per_layer < 1 \
            or weights.num_experts % experts_per_layer:
        raise ValueError(f"experts_per_layer must be an int >= 1 dividing num_experts={weights.num_experts}, "
                         f"got {experts_per_layer!r}")
    return _mlp(x, offs, weights, experts_per_layer, config, out)


def _mlp(x, offs, weights, experts_per_layer: int, config: StreamConfig, out):
    """Both forms, their arguments checked: the gate/up GEMM (silu fused), the down GEMM."""
    from afd_cupy.moe.fp8 import FP8ExpertWeights

    reason = _device_reason(str(x.device))
    if reason is not None:
        raise ValueError(f"streamed expert GEMMs unavailable on {x.device}: {reason}")
    rows, inter = x.shape[0], weights.intermediate_size
    if out is None:
        out = x.new_empty((rows, weights.hidden_size))
    elif tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or out.device != x.device \
            or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} on {x.device} with unit column "
                         f"stride, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if rows == 0:
        return out
    gemm = functools.partial(_launch, offs=offs, experts_per_layer=experts_per_layer, config=config,
                             block_m=config.block_m or row_block(rows, experts_per_layer))
    is_fp8 = isinstance(weights, FP8ExpertWeights)
    w13_scale, w2_scale = (weights.w13_scale, weights.w2_scale) if is_fp8 else (None, None)
    if weights.activation == "silu":
        hidden = x.new_empty((rows, inter))
        gemm(x, weights.w13, w13_scale, hidden, n=inter, glu=True)
    else:
        gate_up = x.new_empty((rows, 2 * inter))
        gemm(x, weights.w13, w13_scale, gate_up, n=2 * inter, glu=False)
        hidden = act_and_mul(gate_up, x.dtype, weights)
    gemm(hidden, weights.w2, w2_scale, out, n=weights.hidden_size, glu=False)
    return out


def _launch(x, w, scale, out, *, n: int, glu: bool, offs, experts_per_layer: int, config: StreamConfig,
            block_m: int):
    num_groups, _, k = w.shape
    interpret = x.device.type == "cpu"
    grid = (-(-n // config.block_n), experts_per_layer)
    launch_shape = {} if interpret else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    _kernel(interpret)[grid](
        x, w, scale if scale is not None else out, offs, out, n, k, experts_per_layer,
        num_groups // experts_per_layer, x.stride(0), w.stride(0), w.stride(1),
        scale.stride(0) if scale is not None else 0, out.stride(0), n if glu else 0, GLU=glu,
        HAS_SCALE=scale is not None, F32_DOT=interpret, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, **launch_shape)


def _check(x, groups, weights, name: str) -> None:
    """The arguments both forms share (``groups``: the counts or offsets, called ``name``)."""
    from afd_cupy.moe.fp8 import FP8ExpertWeights

    is_fp8 = isinstance(weights, FP8ExpertWeights)
    if not is_fp8 and not isinstance(weights, ExpertWeights):
        raise ValueError(f"weights must be moe.ExpertWeights or moe.FP8ExpertWeights, got {type(weights).__name__}")
    if weights.has_bias or weights.gate is not None:
        raise ValueError("the streamed expert GEMMs run experts without biases or a gate")
    if x.dim() != 2 or x.shape[1] != weights.hidden_size or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, {weights.hidden_size}] with unit column stride, got "
                         f"{tuple(x.shape)} strides {tuple(x.stride())}")
    allowed = (torch.bfloat16, torch.float16, torch.float32)
    if x.dtype not in allowed or (not is_fp8 and x.dtype != weights.dtype):
        raise ValueError(f"x has dtype {x.dtype}: needs one of {allowed}"
                         + ("" if is_fp8 else f" matching the weights' {weights.dtype}"))
    if x.device.type == "cuda" and x.dtype == torch.float32:
        raise ValueError("fp32 rows run on the CPU only (the GPU path is for bf16 / fp16)")
    tensors = (weights.w13, weights.w2) + ((weights.w13_scale, weights.w2_scale) if is_fp8 else ())
    if any(t.device != x.device for t in tensors) or not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"the expert weights must be contiguous on x's device {x.device}")
    if groups.dim() != 1 or groups.shape[0] != weights.num_experts or groups.is_floating_point() \
            or groups.device != x.device:
        raise ValueError(f"{name} must be an int [{weights.num_experts}] tensor on {x.device}, got "
                         f"{tuple(groups.shape)} {groups.dtype} on {groups.device}")


# --------------------------------------------------------------------------- compile check

#: the kernel's arguments the JIT sees 16-divisible in practice (pointers, H, I, strides)
_DIVISIBLE = ("x_ptr", "w_ptr", "scale_ptr", "offs_ptr", "out_ptr", "N", "K", "stride_xm",
              "stride_we", "stride_wn", "stride_se", "stride_om", "up_offset")


def compile_check(arch: int = 90, config: StreamConfig = DEFAULT_CONFIG, block_m: int = 32) -> list[dict]:
    """Compile every specialization the MLPs launch (gate/up fused or not, bf16/fp16 rows with
    weights of their dtype or E4M3) for ``sm_<arch>`` without a GPU (Triton's own ptxas), with
    the 16-divisible arguments the JIT specializes on. Returns per specialization its shared
    memory bytes and the PTX's ``cp.async`` and ``mma`` counts (pipelined loads, tensor-core
    MMAs). Not under ``TRITON_INTERPRET=1``."""
    triton = _triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    names = list(_stream_gemm.__code__.co_varnames[:_stream_gemm.__code__.co_argcount])
    kernel, out = JITFunction(_stream_gemm), []
    for glu, rows, fp8 in itertools.product((True, False), ("bf16", "fp16"), (False, True)):
        weights = "fp8e4nv" if fp8 else rows
        types = {"x_ptr": f"*{rows}", "w_ptr": f"*{weights}", "scale_ptr": "*fp32", "offs_ptr": "*i32",
                 "out_ptr": f"*{rows}"}
        constants = {"GLU": glu, "HAS_SCALE": fp8, "F32_DOT": False, "BLOCK_M": block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
        signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE}
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        ptx = compiled.asm["ptx"]
        out.append({"glu": glu, "rows": rows, "weights": weights, "shared_bytes": compiled.metadata.shared,
                    "cp_async": ptx.count("cp.async."), "mma": ptx.count("mma.")})
    return out
