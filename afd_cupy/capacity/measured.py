"""The GPU runs the planner is validated on, as :class:`~afd_cupy.capacity.validate.MeasuredRun`:
the shipped JSON of the current code (``data/``, prefill and decode) and two older
``tools/bench_afd.py`` runs quoted in docs/benchmarks.md of ca1687d (git history) and issue #36.

Numbers marked *derived* are not printed in the source but follow from printed ones through
bench_afd's own definitions (tokens/s = tokens per batch / mean batch time; ideal =
(sum n_a / solo_a) / (sum n_a / lockstep_a); lockstep replicas run the same number of batches
in the same wall time, so their mean batch times are equal).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from afd_cupy.capacity import calibrate as cal
from afd_cupy.capacity.spec import ModelShape
from afd_cupy.capacity.validate import Case, MeasuredRun, runs_from_decode_report, runs_from_sweep

#: The expert weight-read floor is not identifiable from two solo batches (both scale with
#: the FFN), so it comes from ONE-process measurements of the same expert shape (the H200
#: defaults of costs.h200_costs: 2.6 TB/s, saturating at 55 % of the SMs, i.e. 483 us for the
#: 66 experts at a 50 % share, bench_step_graph with the carve-out "auto"). 0210a59 predates
#: the carve-out (e055514): its expert GEMMs ran next to the Attention's spinning wait, 1.45x
#: slower (probe_spin_gemm: 423 -> 615 us at 768 rows), so its weight-read rate is / 1.45.
WEIGHT_READ_NO_CARVEOUT_GBPS = 2600.0 / 1.45

#: bench_afd --quick's synthetic DeepSeek-V2-Lite shape: 4 layers
V2_LITE_QUICK = ModelShape(layers=4, hidden=2048, experts=64, top_k=6, intermediate=1408, shared_experts=2)

#: the run whose co-run solo round gives the contention terms a bench_afd run of the V2-Lite
#: quick model does not measure itself (the only bench_afd run with that round and the FFN's
#: busy time in it)
PREFILL_CONTENTION_FROM = "7a386e3 prefill 0:50,0:50,0:100"


#: issue #36 (ca1687d, one H200, MPS 30/30/40 %: ``bench_afd --quick --attn 2 --ffn 1
#: --placement 0:30,0:30,0:40``). Printed: uniform async/lockstep 1.70, ideal 1.94; skewed 1.06,
#: ideal 1.29, short replica async / lockstep / solo 14.5 / 26.7 / 6.57 ms. Derived: the long
#: replica's solo 23.9 ms (from the ideal) and async 26.4 ms (from the ratio); lockstep 26.7
#: for both replicas.
CA1687D_30_30_40 = MeasuredRun(
    name="ca1687d 2A1F 30/30/40", source="issue #36 (bench_afd --quick, one H200, MPS)",
    contention_from=PREFILL_CONTENTION_FROM,
    shape=V2_LITE_QUICK, placement="0:30,0:30,0:40", num_attn=2,
    cases=(Case("uniform", ((2048,), (2048,)), (None, None), ratio=1.70, ideal=1.94),
           Case("skewed", ((4096,), (256,)), (23.9, 6.57),
                batch_ms={"async": (26.4, 14.5), "lockstep": (26.7, 26.7)}, ratio=1.06, ideal=1.29)))

#: docs/benchmarks.md of ca1687d (git history) "bench_afd on the GPU, first run" (0210a59, one H200, MPS 25/25/50 %,
#: 2 s per phase, skewed only). Printed: tokens/s total and per replica (solo), FFN busy,
#: async/lockstep 1.08, ideal 1.39. Derived: batch ms = tokens per batch / tokens/s.
R0210A59_25_25_50 = MeasuredRun(
    name="0210a59 2A1F 25/25/50", source="docs/benchmarks.md of ca1687d (git history), first GPU run of bench_afd",
    contention_from=PREFILL_CONTENTION_FROM,
    shape=V2_LITE_QUICK, placement="0:25,0:25,0:50", num_attn=2, weight_read_gbps=WEIGHT_READ_NO_CARVEOUT_GBPS,
    cases=(Case("skewed", ((4096,), (256,)), (4096 / 1.92e5 * 1e3, 256 / 45041 * 1e3),
                batch_ms={"async": (4096 / 1.65e5 * 1e3, 256 / 20590 * 1e3),
                          "lockstep": (4096 / 1.61e5 * 1e3, 256 / 10066 * 1e3)},
                tokens_per_s={"async": 1.85e5, "lockstep": 1.71e5},
                ffn_busy={"async": 0.905, "lockstep": 0.689}, ratio=1.08, ideal=1.39),))

#: the JSON of the GPU runs shipped with the package (afd_cupy/capacity/data/), one H200 under
#: MPS, every rank at 50 % but the prefill FFN at 100 % in the 0:50,0:50,0:100 splits:
#: - bench_afd's skew x split sweep (prefill, skews 1, 4, 16): at 0769db3 (splits 0:50,0:50,0:50
#:   and 0:50,0:50,0:100; ``tools/gpu_suite.sh plan1``), at 297227e (0:50,0:50,0:100, with the
#:   FFN's busy time in every solo window) and at 7a386e3 (the same, and the co-run solo round);
#: - bench_decode's two presets (decode): at 9103b75 on the Python loop for both schedules
#:   (``--ffn-serving loop``; co-run solo round), at 297227e on the default serving (async and the
#:   solo rounds on the graph FFN, lockstep on the loop: only its async rows are predicted; co-run
#:   solo round and the FFN's busy time in every solo window).
DATA_DIR = Path(__file__).parent / "data"
SWEEP_0769DB3 = DATA_DIR / "bench_afd_sweep_0769db3.json"
SWEEP_297227E = DATA_DIR / "bench_afd_sweep_297227e.json"
SWEEP_7A386E3 = DATA_DIR / "bench_afd_sweep_7a386e3.json"
DECODE_LOOP = DATA_DIR / "bench_decode_loop_9103b75.json"
DECODE_DEFAULT = DATA_DIR / "bench_decode_default_297227e.json"


def shipped_runs() -> tuple:
    """The runs of the shipped JSON (current code): one MeasuredRun per sweep split and per
    decode placement of each decode report. A run whose own co-run round is missing or did
    not record the FFN's busy time takes those terms from the same benchmark's run that did
    (``contention_from``): the bench_afd sweeps from 7a386e3's, the loop's decode placements
    from the default serving's of the same placement (297227e)."""
    runs = []
    for path in (SWEEP_0769DB3, SWEEP_297227E, SWEEP_7A386E3):
        sweep = cal.read_json(str(path), "bench_afd")
        runs += [run if run.name == PREFILL_CONTENTION_FROM
                 else dataclasses.replace(run, contention_from=PREFILL_CONTENTION_FROM)
                 for run in runs_from_sweep(sweep, f"{sweep['run']['commit']} prefill")]
    decode_default = cal.read_json(str(DECODE_DEFAULT), "bench_decode")
    default_name = f"{decode_default['run']['commit']} decode default"
    loop = cal.read_json(str(DECODE_LOOP), "bench_decode")
    runs += [dataclasses.replace(run, contention_from=f"{default_name} {run.name.rsplit(' ', 1)[1]}")
             for run in runs_from_decode_report(loop, f"{loop['run']['commit']} decode loop")]
    runs += runs_from_decode_report(decode_default, default_name)
    return tuple(runs)


#: runs quoted from older commits' docs (their JSON is not in the repository)
QUOTED_RUNS = (CA1687D_30_30_40, R0210A59_25_25_50)
GPU_RUNS = QUOTED_RUNS + shipped_runs()

#: rows no run has measured yet (the doc's validation table lists them)
NOT_MEASURED = (
    "two GPUs (nvidia-h200-x2): replicas on GPU 0, the FFN on GPU 1 (0:50,0:50,1), NVLink link",
    "2A2F at 25 % each (8a90d44, a845bad): no solo batches in those runs, so nothing to calibrate on",
)
