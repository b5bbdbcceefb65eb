"""Do this process's GEMMs compute what they should? A check to run before trusting numbers.

On one H200 with torch 2.11.0+cu130, a process whose CUDA MPS SM share
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) is 45 or less gets wrong bf16 GEMMs from
``torch.nn.functional.linear`` at decode shapes (64 x 2048 -> 3072): some output tiles are
never written, so the result holds whatever the memory held before (zeros on fresh memory,
NaNs on reused memory). A plain torch process without afd_cupy shows it; 50 and 100 are right.
torch's SM carve-out does not change it (docs/performance.md, "Known issues"). Anything that
runs its model under such a share gives wrong outputs that look like a transport defect; this
check tells the two apart in a second.

:func:`check_gemms` multiplies seeded random operands of each shape on ``device`` twice (the
second time into reused memory: where unwritten tiles show up as NaN) and compares with the
same product in fp64 on the CPU.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

#: Relative Frobenius error a bf16 GEMM with fp32 accumulation stays well inside (the broken
#: case above is ~1.0: whole tiles missing).
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}


def check_gemms(shapes: Iterable[tuple[int, int, int]], device, *, dtype: str = "bfloat16", seed: int = 0,
                linear: Callable | None = None) -> dict:
    """Check ``y = x @ w.T`` for every ``(m, n, k)`` in ``shapes`` (x [m, k], w [n, k] of
    ``dtype`` on ``device``) against fp64 on the CPU.

    ``linear`` (default ``torch.nn.functional.linear``): the function under test, for tests.
    Returns ``{"ok", "dtype", "mps_share_pct", "tolerance", "results": [{"m", "n", "k",
    "rel_err", "nan", "ok"}, ...]}``; ``mps_share_pct`` is this process's
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (None when unset). Raises ValueError for an unknown
    dtype or a shape that is not three positive ints.
    """
    import torch
    import torch.nn.functional as F

    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {dtype!r}")
    linear = linear or F.linear
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    results = []
    for shape in shapes:
        if len(shape) != 3 or not all(isinstance(v, int) and v > 0 for v in shape):
            raise ValueError(f"a GEMM shape is (m, n, k) of positive ints, got {shape!r}")
        m, n, k = shape
        x = torch.randn((m, k), generator=gen).to(torch_dtype)
        w = (torch.randn((n, k), generator=gen) / k ** 0.5).to(torch_dtype)
        ref = x.double() @ w.double().T
        xd, wd = x.to(device), w.to(device)
        worst, nan = 0.0, 0
        for _ in range(2):  # the second product lands in memory the first one's temporaries used
            got = linear(xd, wd).double().cpu()
            nan = max(nan, int(torch.isnan(got).sum()))
            err = float((got - ref).norm() / ref.norm()) if not nan else float("inf")
            worst = max(worst, err)
        results.append({"m": m, "n": n, "k": k, "rel_err": worst, "nan": nan,
                        "ok": nan == 0 and worst <= TOLERANCE[dtype]})
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    return {"ok": all(r["ok"] for r in results), "dtype": dtype, "tolerance": TOLERANCE[dtype],
            "mps_share_pct": int(share) if share and share.isdigit() else None, "results": results}


def describe_failure(report: dict) -> str:
    """One line naming the shapes :func:`check_gemms` found wrong and the MPS share."""
    bad = [r for r in report["results"] if not r["ok"]]
    shapes = ", ".join(f"{r['m']}x{r['k']}->{r['n']} (rel err {r['rel_err']:.3g}, {r['nan']} NaN)" for r in bad)
    share = report["mps_share_pct"]
    where = f"under MPS share {share}%" if share is not None else "without an MPS share"
    return (f"{report['dtype']} GEMMs wrong {where}: {shapes}; torch's GEMM itself is wrong here, not the AFD "
            "path (docs/performance.md, Known issues)")
