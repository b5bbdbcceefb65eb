"""CPU tests of the planner's one-GPU terms: the fluid contention model with a κ per kind of
phase, the service-time noise, and their fits to solo-type rounds (afd_cupy.capacity:
sim, contention, noise), against hand-computed bounds."""
from __future__ import annotations

import dataclasses

import pytest

from afd_cupy.capacity import Deployment, Link, ModelShape, ReplicaLoad, SimConfig, parse_placements, simulate
from afd_cupy.capacity import calibrate as cal
from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.contention import BENCH_CORUN_FFN_KAPPA, Contention
from afd_cupy.capacity.noise import fit_noise, solo_spread
from afd_cupy.capacity.validate import Case, MeasuredRun, validate_runs
from afd_cupy.errors import ConfigError

from helpers.capacity import small_costs

SHAPE = ModelShape(layers=4, hidden=256, experts=16, top_k=2, intermediate=128, shared_experts=1)
LINK = Link(100.0, 3e-6)


def prefill(*lengths, ffn: bool = True) -> ReplicaLoad:
    return ReplicaLoad("prefill", tuple(lengths), ffn=ffn)


def two_gpus(**kw) -> Deployment:
    """Two replicas sharing GPU 0 (50 % each), the FFN alone on GPU 1."""
    return Deployment(parse_placements("0:50,0:50"), parse_placements("1"), same_gpu=LINK, intra_node=LINK,
                      mps_caps=True, **kw)


def one_gpu(**kw) -> Deployment:
    """Two replicas and the FFN on GPU 0, 50 % each (MPS caps)."""
    return Deployment(parse_placements("0:50,0:50"), parse_placements("0:50"), same_gpu=LINK, mps_caps=True, **kw)


# --------------------------------------------------------------------------- noise

def test_noise_cv_zero_is_the_deterministic_run_exactly():
    loads = (prefill(256), prefill(64))
    for dep in (one_gpu(), one_gpu(hbm_contention=0.4)):
        plain = simulate(SHAPE, dep, loads, small_costs(), SimConfig(steps=6)).to_dict()
        for seed in (0, 5):
            assert simulate(SHAPE, dep, loads, small_costs(), SimConfig(steps=6, seed=seed, noise_cv=0.0)).to_dict() == plain


def test_noise_keeps_a_lone_replicas_mean_and_widens_its_spread():
    dep = Deployment(parse_placements("0:50"), parse_placements("0:50"), same_gpu=LINK)
    plain = simulate(SHAPE, dep, (prefill(256),), small_costs(), SimConfig(steps=400)).replicas[0]
    noisy = [simulate(SHAPE, dep, (prefill(256),), small_costs(), SimConfig(steps=400, seed=s, noise_cv=0.2)).replicas[0]
             for s in (0, 1)]
    assert plain.step_p99_s == pytest.approx(plain.step_p50_s, rel=1e-9)  # constant costs: every step alike
    for r in noisy:  # a lone replica's step is a sum of its phases: the mean-1 noise keeps its mean
        assert r.step_mean_s == pytest.approx(plain.step_mean_s, rel=0.02)
        assert r.step_p99_s > 1.1 * r.step_p50_s
    assert noisy[0].step_p99_s != noisy[1].step_p99_s  # seeds draw different noise
    with pytest.raises(ConfigError, match=r"SimConfig\.noise_cv"):
        SimConfig(noise_cv=-0.1)


def test_lockstep_never_beats_async_when_the_ffn_is_idle_half_the_time_even_with_noise():
    c = small_costs(weight_read_gbps=1e9, gemm_tflops=100.0, attn_fixed_s=150e-6)  # merging saves nothing
    dep = Deployment.one_per_gpu(2, 1, intra_node=LINK)
    for lengths in ((256, 256), (512, 32)):
        loads = tuple(prefill(n) for n in lengths)
        for seed in range(3):
            fast = simulate(SHAPE, dep, loads, c, SimConfig("async", steps=30, seed=seed, noise_cv=0.1))
            slow = simulate(SHAPE, dep, loads, c, SimConfig("lockstep", steps=30, seed=seed, noise_cv=0.1))
            assert fast.ffn_busy <= 0.5 and fast.tokens_per_s >= slow.tokens_per_s, (lengths, seed)


def test_a_saturated_ffn_caps_throughput_at_its_service_rate_with_noise_and_contention():
    c = small_costs(gemm_tflops=0.002)  # the FFN ~100x slower than attention
    loads = tuple(prefill(64) for _ in range(4))
    dep = Deployment(parse_placements("0:25,0:25,0:25,0:25"), parse_placements("1"), same_gpu=LINK, intra_node=LINK,
                     hbm_contention=0.5, ffn_contention=0.5)  # the FFN alone on its GPU: never slowed
    service = max(c.ffn_item_s, cm.expert_gemm_time(c, SHAPE, 64, 1, 1.0))
    cap = 64 / (SHAPE.layers * service)
    res = simulate(SHAPE, dep, loads, c, SimConfig(steps=20, noise_cv=0.1))
    assert 0.9 * cap <= res.tokens_per_s <= 1.05 * cap  # the noise's mean is 1: the cap holds on average
    assert res.ffn_busy > 0.98


# --------------------------------------------------------------------------- contention

def test_per_phase_contention_with_equal_factors_is_the_scalar_one():
    loads = (prefill(256), prefill(64))
    for kappa in (0.2, 1.0):
        scalar = simulate(SHAPE, one_gpu(hbm_contention=kappa), loads, small_costs(), SimConfig(steps=6)).to_dict()
        both = simulate(SHAPE, one_gpu(hbm_contention=kappa, ffn_contention=kappa), loads, small_costs(),
                        SimConfig(steps=6)).to_dict()
        assert both == scalar
    assert one_gpu(hbm_contention=0.3).contention("ffn") == 0.3
    assert one_gpu(hbm_contention=0.3, ffn_contention=0.0).contention("ffn") == 0.0
    with pytest.raises(ConfigError, match=r"Deployment\.ffn_contention"):
        one_gpu(ffn_contention=-1.0)
    with pytest.raises(ConfigError, match=r"Contention\.ffn"):
        Contention(0.1, -0.5)


def test_two_phases_that_overlap_throughout_each_run_slower_by_one_plus_kappa_times_the_others_share():
    c = small_costs(ffn_item_s=0.0, gemm_tflops=1e9, weight_read_gbps=1e12)  # an FFN that never makes one wait
    loads = (prefill(256), prefill(256))  # alike: their attention phases start and end together
    plain = simulate(SHAPE, two_gpus(), loads, c, SimConfig(steps=4))
    slowed = simulate(SHAPE, two_gpus(hbm_contention=0.6), loads, c, SimConfig(steps=4))
    work = cm.attention_time(c, 256, 256 * 257 / 2, 0, 0.5) - c.attn_fixed_s
    extra = SHAPE.layers * work * 0.6 * 0.5  # the variable part only: 1 + κ x the other's 50 %
    for a in range(2):
        assert slowed.replicas[a].step_p50_s == pytest.approx(plain.replicas[a].step_p50_s + extra, rel=1e-6)


def test_a_phase_is_slowed_only_for_the_part_that_overlaps_another():
    shape = dataclasses.replace(SHAPE, layers=1)
    c = small_costs(gemm_tflops=0.01)  # a long FFN trip: the short replica's next attention comes late
    loads = (prefill(512), prefill(128))
    first = SimConfig(warmup_steps=0, steps=1)
    plain = simulate(shape, two_gpus(), loads, c, first)
    slowed = simulate(shape, two_gpus(hbm_contention=1.0), loads, c, first)
    work = [cm.attention_time(c, n, n * (n + 1) / 2, 0, 0.5) - c.attn_fixed_s for n in (512, 128)]
    # both start together at half speed (κ 1 x the other's 50 %) until the short one ends,
    # then the long one runs alone: it is slowed for the short one's work only
    assert plain.replicas[1].step_p50_s + 1.0 * work[1] * 0.5 < plain.replicas[0].step_p50_s  # no second overlap
    assert slowed.replicas[1].step_p50_s == pytest.approx(plain.replicas[1].step_p50_s + 0.5 * work[1], rel=1e-9)
    assert slowed.replicas[0].step_p50_s == pytest.approx(plain.replicas[0].step_p50_s + 0.5 * work[1], rel=1e-9)


def test_fixed_costs_neither_load_the_gpu_nor_slow():
    c = small_costs(attn_per_token_s=0.0, attn_per_pair_s=0.0)  # attention = its fixed cost only
    loads = (prefill(256), prefill(256, ffn=False))
    alone = simulate(SHAPE, one_gpu(), (loads[0],) * 2, c, SimConfig(steps=4))
    for kappa in (0.0, 2.0):  # a background of launches only costs the sender nothing
        res = simulate(SHAPE, one_gpu(hbm_contention=kappa), loads, c, SimConfig(steps=4))
        assert res.ffn[0].busy_per_batch_s == pytest.approx(cm.expert_gemm_time(c, SHAPE, 256, 1, 0.5), rel=1e-9)
    assert alone.replicas[0].step_p50_s > 0


def test_the_ffn_term_slows_the_expert_gemms_beside_a_running_attention():
    c = small_costs(attn_fixed_s=0.0)  # the background's attention runs back to back: always overlapping
    loads = (prefill(64), prefill(2048, ffn=False))
    gemm = cm.expert_gemm_time(c, SHAPE, 64, 1, 0.5)
    res = simulate(SHAPE, one_gpu(hbm_contention=0.0, ffn_contention=0.4), loads, c, SimConfig(steps=4))
    assert res.ffn[0].busy_per_batch_s == pytest.approx(gemm * (1 + 0.4 * 0.5), rel=1e-9)
    plain = simulate(SHAPE, one_gpu(), loads, c, SimConfig(steps=4))
    assert plain.ffn[0].busy_per_batch_s == pytest.approx(gemm, rel=1e-12)


# --------------------------------------------------------------------------- fits to solo-type rounds

def _spread_run(cv_true: float) -> MeasuredRun:
    """A 2A1F prefill MeasuredRun whose solo spreads the simulator made at ``cv_true``."""
    case = Case("skew", ((512,), (64,)), (None, None))
    run = MeasuredRun("synthetic", "test", SHAPE, "0:50,0:50,0:50", 2, (case,), link=LINK)
    spreads = tuple(solo_spread(run, small_costs(), case, a, cv_true) for a in range(2))
    return dataclasses.replace(run, cases=(dataclasses.replace(case, solo_spread=spreads),))


def test_fit_noise_recovers_the_cv_that_made_the_solo_spreads():
    for cv in (0.05, 0.3):
        assert fit_noise(_spread_run(cv), small_costs()) == pytest.approx(cv, rel=0.02)
    bare = MeasuredRun("synthetic", "test", SHAPE, "0:50,0:50,0:50", 2, (Case("skew", ((512,), (64,)), (None, None)),))
    assert fit_noise(bare, small_costs()) is None  # nothing measured: no noise


def test_a_run_without_a_co_run_round_takes_its_terms_from_contention_from(monkeypatch):
    from afd_cupy.capacity import validate as validate_mod

    monkeypatch.setattr(validate_mod, "calibrated_costs", lambda run, base=None: small_costs())
    lengths = ((2048, 16), (128, 16))
    made = MeasuredRun("donor", "test", SHAPE, "0:50,0:50,0:50", 2,
                       (Case("skew", lengths, (None, None), kind="decode", output_len=8),))
    # no FFN busy time in the donor's round: its FFN term is bench_corun's, its attention's fitted
    corun = validate_mod.predict_corun(made, small_costs(), made.cases[0], Contention(0.5, BENCH_CORUN_FFN_KAPPA),
                                       cal.SIM_FOR_BENCH)
    donor = dataclasses.replace(made, cases=(dataclasses.replace(made.cases[0], corun_ms=tuple(c.step_ms for c in corun)),))
    taker = dataclasses.replace(made, name="taker", contention_from="donor")
    out = {run.name: rows for run, _, rows in validate_runs([(taker, None), (donor, None)])}
    donor_kappa = (out["donor"][0]["hbm_contention"], out["donor"][0]["ffn_contention"])
    assert donor_kappa[0] == pytest.approx(0.5, rel=0.05)  # the donor's attention term, fitted to its co-run
    assert all((r["hbm_contention"], r["ffn_contention"]) == donor_kappa for r in out["taker"])


# --------------------------------------------------------------------------- attention beside the GEMMs

def test_an_attention_beside_a_gemm_takes_its_own_kappa():
    """Deployment.attn_gemm_contention: an attention phase's κ per unit share of the expert-GEMM
    phases beside it (the one-GPU fluid's κ matrix); None keeps one κ per kind of phase."""
    dep = one_gpu(hbm_contention=0.2, ffn_contention=0.4, attn_gemm_contention=1.5)
    assert dep.contention("attention", "ffn") == 1.5 and dep.contention("attention", "attention") == 0.2
    assert dep.contention("ffn", "attention") == 0.4 and dep.contention("attention") == 0.2
    assert one_gpu(hbm_contention=0.2).contention("attention", "ffn") == 0.2
    assert one_gpu(attn_gemm_contention=0.5).contended
    with pytest.raises(ConfigError, match="attn_gemm_contention"):
        one_gpu(attn_gemm_contention=-1.0)
    # the rates: an attention beside one GEMM at 50 % and another attention at 50 %
    from afd_cupy.capacity.shared_gpu import Phase, SharedGPUs

    ends = []
    gpus = SharedGPUs(dep, lambda t, gpu, who, version: ends.append((who, t)))
    gpus.begin(0.0, (0, 0), "a0", Phase(0.5, "attention", 1.0, ()))
    gpus.begin(0.0, (0, 0), "a1", Phase(0.5, "attention", 1.0, ()))
    gpus.begin(0.0, (0, 0), "f", Phase(0.5, "ffn", 1.0, ()))
    rates = {who: phase.rate for who, phase in gpus.running[(0, 0)].items()}
    assert rates["a0"] == pytest.approx(1 / (1 + 0.2 * 0.5 + 1.5 * 0.5))
    assert rates["f"] == pytest.approx(1 / (1 + 0.4 * 1.0))


def _background_run(truth: Contention, with_background: bool = True) -> MeasuredRun:
    """A 2A1F prefill run on one GPU whose co-run solo round the simulator made at ``truth``:
    each replica's co-run batch, the FFN's busy ms per item (solo and co-run) and, where
    ``with_background``, the other replica's attention-only pace (calibrate.BackgroundPace)."""
    from afd_cupy.capacity.contention import predict_corun

    costs = small_costs(gemm_tflops=0.05)  # long GEMMs: the background's attention overlaps them
    case = Case("skew", ((1024,), (256,)), (None, None))
    run = MeasuredRun("synthetic", "test", SHAPE, "0:50,0:50,0:100", 2, (case,), link=LINK)
    corun = predict_corun(run, costs, case, truth, cal.SIM_FOR_BENCH)
    solo = tuple(cm.expert_gemm_time(costs, SHAPE, n, 1, 1.0) * 1e3 for n in case.tokens())
    background = None
    if with_background:
        background = tuple((cal.BackgroundPace(1 - a, 40, c.background_ms[1 - a] / SHAPE.layers, None, None, None, 0.9),)
                           for a, c in enumerate(corun))
    made = dataclasses.replace(case, corun_ms=tuple(c.step_ms for c in corun), solo_ffn_item_ms=solo,
                               corun_ffn_item_ms=tuple(c.ffn_item_ms for c in corun), corun_background=background)
    return dataclasses.replace(run, cases=(made,)), costs


@pytest.mark.parametrize("beside", [0.8, 2.5])
def test_fit_contention_recovers_the_attention_beside_gemm_term_from_the_background_pace(beside):
    """The background replicas' pace pins the attention's κ beside the GEMMs; the fitted terms
    reproduce every co-run quantity the synthetic round recorded (the attention's own κ and the
    FFN's trade off against each other here: the co-run step depends on both)."""
    from afd_cupy.capacity.contention import fit_contention, predict_corun

    truth = Contention(0.3, 0.6, beside)
    run, costs = _background_run(truth)
    even = _background_run(Contention(0.3, 0.6, 0.3))[0].cases[0].corun_background[0][0].layer_mean_ms
    assert run.cases[0].corun_background[0][0].layer_mean_ms > 1.02 * even  # the term is identifiable
    fitted = fit_contention(run, costs, cal.SIM_FOR_BENCH, Contention(0.0, 0.05))
    assert fitted.attention_beside_ffn == pytest.approx(beside, rel=0.05), fitted
    case = run.cases[0]
    for a, pred in enumerate(predict_corun(run, costs, case, fitted, cal.SIM_FOR_BENCH)):
        assert pred.step_ms == pytest.approx(case.corun_ms[a], rel=0.02)
        assert pred.ffn_item_ms == pytest.approx(case.corun_ffn_item_ms[a], rel=0.02)
        pace = case.corun_background[a][0]
        assert pred.background_ms[pace.replica] == pytest.approx(pace.layer_mean_ms * SHAPE.layers, rel=0.02)
    bare, _ = _background_run(truth, with_background=False)
    assert fit_contention(bare, costs, cal.SIM_FOR_BENCH, Contention(0.0, 0.05)).attention_beside_ffn is None
