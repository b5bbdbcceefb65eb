"""Costs from the benchmarks' JSON: ``tools/bench_transport.py`` and ``tools/bench_afd.py``.

- :func:`transport_costs` reads a ``bench_transport.json``: the prefill rows' dispatch and
  combine times against their wire bytes give each direction's fixed cost and bandwidth (a
  least-squares line; one point: the fixed part from the decode round trip), the decode round
  trip at its smallest token count gives the FFN's fixed cost per item.
- :func:`solo_points` reads a ``bench_afd.json``: every replica's SOLO batch time (the async
  launch runs each replica alone after each phase) with its request lengths and the shares.
- :func:`fit_costs` scales the attention and the expert costs (two factors, and the fixed
  per-layer cost when there are three or more distinct solo points) so that one replica
  alone reproduces those solo batch times. Only solo numbers are used: the multi-replica
  rows of the same run stay out of the fit, so they can validate the simulator.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.spec import Link, ModelShape, Placement, SimConfig
from afd_cupy.errors import ConfigError


def read_json(path: str, tool: str) -> dict:
    """The report at ``path``; ConfigError unless its ``tool`` field is ``tool``."""
    try:
        with open(path) as fh:
            report = json.load(fh)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {tool} JSON {path!r}: {err}") from None
    if report.get("tool") != tool:
        raise ConfigError(f"{path!r} is a {report.get('tool')!r} report, expected {tool!r}")
    return report


def _line_fit(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of a least-squares line; one point: (0, y / x)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) == 1 or np.ptp(xs) == 0:
        return 0.0, float(ys.mean() / xs.mean())
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(0.0, float(intercept)), max(float(slope), 1e-18)


def transport_costs(path: str, base: cm.Costs) -> tuple[cm.Costs, Link]:
    """(``base`` with dispatch/combine/FFN-item fixed costs from ``path``, the measured link).

    The link's bandwidth is the slower direction's; its latency 0 (the fixed costs hold it)."""
    report = read_json(path, "bench_transport")
    prefill = [r for r in report.get("prefill", []) if r.get("dispatch_ms") and r.get("combine_ms")]
    decode = [r for r in report.get("decode", []) if r.get("rt_median_us")]
    if not prefill:
        raise ConfigError(f"{path!r} has no prefill rows with dispatch_ms and combine_ms")
    d_fixed, d_slope = _line_fit([r["dispatch_wire_bytes"] for r in prefill],
                                 [r["dispatch_ms"] * 1e-3 for r in prefill])
    c_fixed, c_slope = _line_fit([r["reply_wire_bytes"] for r in prefill],
                                 [r["combine_ms"] * 1e-3 for r in prefill])
    updates = {"dispatch_fixed_s": d_fixed, "combine_fixed_s": c_fixed}
    if decode:
        smallest = min(decode, key=lambda r: r["tokens"])
        rt = smallest["rt_median_us"] * 1e-6
        updates["ffn_item_s"] = max(0.0, rt - d_fixed - c_fixed)
    link = Link(1.0 / max(d_slope, c_slope) / 1e9, 0.0, f"measured ({path})")
    return base.replace(source=f"{base.source} + bench_transport {report.get('run', {}).get('commit')}",
                        **updates), link


@dataclass(frozen=True)
class SoloPoint:
    """One replica alone: its request ``lengths``, mean solo batch time, the shares and F."""

    workload: str
    replica: int
    lengths: tuple
    solo_batch_s: float
    attn_share: float
    ffn_share: float
    num_ffn: int
    ffn_busy_per_item_s: float | None = None  # the FFN's busy time per item in that solo window


_GPU_RE = re.compile(r"rank (\d+) \((attention|ffn)\): GPU (\d+)(?: at (\d+)% of its SMs)?")


def report_placements(report: dict, num_attn: int, num_ffn: int) -> tuple:
    """One Placement per rank (Attention first) from a bench_afd report's ``mps`` record;
    share 1.0 where none was set (one process per GPU, or the host backend)."""
    mps = report.get("mps", {})
    found = {int(r): Placement(int(g), int(p) / 100 if p else 1.0)
             for r, _, g, p in _GPU_RE.findall(mps.get("placement", ""))}
    out = []
    for rank in range(num_attn + num_ffn):
        pct = mps.get("attention_pct") if rank < num_attn else mps.get("ffn_pct")
        default = Placement(0, pct / 100) if mps.get("shared_gpu") and pct else Placement(rank, 1.0)
        out.append(found.get(rank, default))
    return tuple(out)


def bench_topology(report: dict) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)A(\d+)F", str(report.get("topology", "")))
    if not match:
        raise ConfigError(f"bench_afd report has no topology like '2A1F': {report.get('topology')!r}")
    return int(match.group(1)), int(match.group(2))


def bench_shape(report: dict, model: dict | None = None) -> ModelShape:
    """The ModelShape of a bench_afd or bench_decode report (``model``: a placement's own
    model record, e.g. bench_decode's ffn-bound with its larger intermediate)."""
    m = model or report["model"]
    return ModelShape(layers=m["layers"], hidden=m["hidden"], experts=m["experts"], top_k=m["top_k"],
                      intermediate=m["intermediate"], shared_experts=m["shared"])


def busy_per_item_s(ffn: dict | None) -> float | None:
    """The FFN's busy seconds per item from a solo window's ``ffn`` stats (busy fraction /
    items per s, as bench_afd and bench_decode record them); None where not measured."""
    if not ffn or not ffn.get("items_per_s") or not ffn.get("busy_fraction"):
        return None
    return ffn["busy_fraction"] / ffn["items_per_s"]


@dataclass(frozen=True)
class BackgroundPace:
    """One replica's attention-only batches (no transport) inside another replica's co-run solo
    window, as bench_afd records them (``solo["corun"]["background"]``): the pace of an
    attention beside the FFN's expert GEMMs and the other replica's attention. ``layers``: the
    layers of its batches wholly inside the window; the times in ms (None where no batch lay
    inside); ``covered_fraction``: the share of the window those batches cover."""

    replica: int
    layers: int
    layer_mean_ms: float | None
    batch_p10_ms: float | None
    batch_median_ms: float | None
    batch_p90_ms: float | None
    covered_fraction: float | None


def background_paces(corun: dict | None) -> tuple | None:
    """One :class:`BackgroundPace` per other replica of a co-run solo row (``solo["corun"]``);
    None where the row recorded no background (runs before bench_afd recorded it, bench_decode)."""
    entries = (corun or {}).get("background")
    if entries is None:
        return None

    def ms(value):
        return None if value is None or value != value else float(value)  # NaN: nothing measured
    return tuple(BackgroundPace(int(e["rank"]), int(e["layers"]), ms(e["layer_mean_ms"]), ms(e["batch_p10_ms"]),
                                ms(e["batch_median_ms"]), ms(e["batch_p90_ms"]), ms(e["covered_fraction"]))
                 for e in entries)


def solo_points(report: dict, shares: tuple | None = None) -> list:
    """Every solo batch of a bench_afd report (async rows); ``shares`` overrides the
    (attention share, ffn share) read from the report."""
    num_attn, num_ffn = bench_topology(report)
    places = report_placements(report, num_attn, num_ffn)
    points = []
    for row in report.get("results", []):
        if row.get("schedule") != "async":
            continue
        for rep in row["replicas"]:
            if not rep.get("solo"):
                continue
            a_share, f_share = shares or (places[rep["rank"]].share, places[num_attn].share)
            points.append(SoloPoint(row["workload"], rep["rank"], tuple(rep["lengths"]),
                                    rep["solo"]["batch_mean_ms"] * 1e-3, a_share, f_share, num_ffn,
                                    ffn_busy_per_item_s=busy_per_item_s(rep["solo"].get("ffn"))))
    return points


def _parts(shape: ModelShape, base: cm.Costs, link: Link, p: SoloPoint) -> tuple:
    """(fixed, attention variable, expert floor, expert compute) seconds of one solo batch."""
    tokens = sum(p.lengths)
    pairs = float(sum(n * (n + 1) // 2 for n in p.lengths))
    attn_var = cm.attention_time(base, tokens, pairs, 0.0, p.attn_share) - base.attn_fixed_s
    floor = cm.expert_gemm_time(base.replace(gemm_tflops=1e12), shape, tokens, p.num_ffn, p.ffn_share)
    compute = cm.expert_gemm_time(base.replace(weight_read_gbps=1e15), shape, tokens, p.num_ffn, p.ffn_share)
    nbytes = cm.wire_rows(shape, tokens, p.num_ffn, "pair") * shape.row_bytes
    fixed = (base.attn_fixed_s + base.dispatch_fixed_s + base.combine_fixed_s + base.ffn_item_s
             + base.ffn_poll_s + 2 * link.time_s(nbytes))
    L = shape.layers
    return L * fixed, L * attn_var, L * floor, L * compute


#: expert-compute scale factors tried by :func:`fit_costs` (log grid, 0.05x .. 1e5x: a CPU too)
GEMM_SCALES = tuple(float(x) for x in np.geomspace(0.05, 1e5, 421))


def fit_costs(shape: ModelShape, points: list, base: cm.Costs, link: Link, *,
              fit_attention: bool = False, scale_floor: bool = False, fixed_on: str = "ffn") -> cm.Costs:
    """``base`` fitted so that a replica alone reproduces ``points`` (least squares on the
    solo batch times, every coefficient >= 0). Always fitted: a fixed cost per layer, added
    to the FFN's per-item host cost (``fixed_on="ffn"``, ``ffn_item_s``: on cuda the Attention
    host issues a whole batch ahead of its stream, one sync per batch, so its issue cost hides
    behind the device, while the FFN's host loop must see an item before it can launch the
    GEMMs) or to the Attention's (``"attention"``, ``attn_fixed_s``), and the expert GEMM's compute rate
    (``gemm_tflops``, by a scale factor searched on a log grid since the GEMM time is
    max(floor, compute)). ``fit_attention``: the attention variable costs scale too (needs
    three or more distinct points); ``scale_floor``: the weight-read floor scales with the
    compute (otherwise ``weight_read_gbps`` stays as given: measure it with one replica at
    small batches, bench_step_graph's FFN experts phase). Where points carry the FFN's busy time
    per item in their solo windows (bench_afd records it), the GEMM scale is the one that
    reproduces those times, and only the rest is fitted to the batch times."""
    if not points:
        raise ConfigError("fit_costs needs at least one solo point (run bench_afd with --solo-duration > 0)")
    parts = np.array([_parts(shape, base, link, p) for p in points])
    y = np.array([p.solo_batch_s for p in points]) - parts[:, 0]
    cols = [np.full(len(points), float(shape.layers))] + ([parts[:, 1]] if fit_attention else [])
    design = np.stack(cols, axis=1)

    def fit_for(k: float, k_floor: float | None = None) -> tuple:
        floor = parts[:, 2] * (k_floor if k_floor is not None else k if scale_floor else 1.0)
        expert = np.maximum(floor, parts[:, 3] * k)
        rest = y - expert - (0.0 if fit_attention else parts[:, 1])
        coef = _nnls(design, rest)
        return float(np.sum((design @ np.asarray(coef) - rest) ** 2)), k, coef

    busy = [(i, p.ffn_busy_per_item_s) for i, p in enumerate(points) if p.ffn_busy_per_item_s]
    k_floor = 1.0
    if busy:  # the FFN's measured busy time per item sets the GEMM costs; the rest fits around it
        k_floor, k_busy = _busy_scales(parts, busy, shape.layers)
        best = fit_for(k_busy, k_floor)
    else:
        best = min((fit_for(k) for k in GEMM_SCALES), key=lambda r: r[0])
        step = GEMM_SCALES[1] / GEMM_SCALES[0]
        for _ in range(3):  # refine around the best grid point
            grid = np.geomspace(best[1] / step, best[1] * step, 41)
            best = min([best] + [fit_for(float(k)) for k in grid], key=lambda r: r[0])
            step = grid[1] / grid[0]
    _, k_f, coef = best
    k_a = coef[1] if fit_attention else 1.0
    extra = coef[0]
    if fixed_on not in ("ffn", "attention"):
        raise ConfigError(f"fit_costs fixed_on must be 'ffn' or 'attention', got {fixed_on!r}")
    fixed = ({"ffn_item_s": base.ffn_item_s + extra} if fixed_on == "ffn"
             else {"attn_fixed_s": base.attn_fixed_s + extra})
    return base.replace(**fixed, attn_per_token_s=base.attn_per_token_s * k_a,
                        attn_per_pair_s=base.attn_per_pair_s * k_a,
                        attn_per_ctx_token_s=base.attn_per_ctx_token_s * k_a,
                        gemm_tflops=base.gemm_tflops / k_f,
                        weight_read_gbps=base.weight_read_gbps / (k_floor if busy else k_f if scale_floor else 1.0),
                        source=f"{base.source}; fitted to {len(points)} solo batches: attention x{k_a:.3g}, "
                               f"expert compute x{k_f:.3g}{' (floor too)' if scale_floor else ''}"
                               f"{f', weight reads x{k_floor:.3g} (both from the FFN busy per item in the solo windows)' if busy else ''}, "
                               f"{fixed_on} fixed +{extra * 1e6:.0f} us/layer")


def _busy_scales(parts: np.ndarray, busy: list, layers: int) -> tuple:
    """(weight-read scale, compute scale) of the expert GEMMs that reproduce the FFN's busy time
    per item of the solo points ``busy`` [(point index, seconds)]: squared relative errors of
    ``max(floor x kf, compute x kc)`` on a log grid, refined around the best pair (a tiny
    tie-break keeps kf = kc where the times do not pin one). One distinct batch size cannot
    tell the two apart: then kf = kc."""
    rows = np.array([i for i, _ in busy])
    per_item = np.array([b for _, b in busy])
    floor, compute = parts[rows, 2] / layers, parts[rows, 3] / layers

    def err(kf, kc):
        model = np.maximum(floor[None, None, :] * kf[:, None, None], compute[None, None, :] * kc[None, :, None])
        # a tie-break toward kf = kc where the busy times do not pin one of them (never binding)
        tie = 1e-9 * np.log(kf[:, None] / kc[None, :]) ** 2
        return np.sum(((model - per_item) / per_item) ** 2, axis=-1) + tie
    grid = np.array(GEMM_SCALES)
    if len(np.unique(compute)) < 2:
        k = grid[int(np.argmin(np.diagonal(err(grid, grid))))]
        for _ in range(3):
            fine = np.geomspace(k / 1.1, k * 1.1, 41)
            k = fine[int(np.argmin(np.diagonal(err(fine, fine))))]
        return float(k), float(k)
    kf, kc = grid, grid
    for _ in range(4):
        e = err(kf, kc)
        i, j = np.unravel_index(int(np.argmin(e)), e.shape)
        best_f, best_c = kf[i], kc[j]
        ratio_f = kf[1] / kf[0]
        ratio_c = kc[1] / kc[0]
        kf = np.geomspace(best_f / ratio_f, best_f * ratio_f, 41)
        kc = np.geomspace(best_c / ratio_c, best_c * ratio_c, 41)
    return float(best_f), float(best_c)


def _nnls(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set over the few columns)."""
    cols = design.shape[1]
    best, best_err = np.zeros(cols), float(np.sum(y ** 2))
    for mask in range(1, 2 ** cols):
        keep = [c for c in range(cols) if mask >> c & 1]
        sol, *_ = np.linalg.lstsq(design[:, keep], y, rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(cols)
        coef[keep] = sol
        err = float(np.sum((design @ coef - y) ** 2))
        if err < best_err - 1e-30:
            best, best_err = coef, err
    return [float(c) for c in best]


#: the simulation length the validation uses for a bench run (steps per replica)
SIM_FOR_BENCH = SimConfig(warmup_steps=2, steps=20)


@dataclass(frozen=True)
class DecodeSoloPoint:
    """One decode replica alone: ``batch`` requests at a mean ``context`` (tokens of KV cache,
    growing by one per step over ``output_len`` steps), its solo time per output token."""

    workload: str
    replica: int
    context: int
    batch: int
    output_len: int
    solo_step_s: float
    attn_share: float
    ffn_share: float
    num_ffn: int
    ffn_busy_per_item_s: float | None = None  # the FFN's busy time per item in that solo window


#: the grids of :func:`fit_decode_costs`: the Attention host's issue per layer and the FFN
#: host's extra per item (0 and 1 us .. 20 ms), the KV-read scale (0.05x .. 50x)
HOST_GRID = (0.0,) + tuple(float(x) for x in np.geomspace(1e-6, 2e-2, 90))
KV_SCALES = tuple(float(x) for x in np.geomspace(0.05, 50.0, 90))


def _decode_parts(shape: ModelShape, base: cm.Costs, link: Link, p: DecodeSoloPoint) -> tuple:
    """(the fixed part of one layer's chain, its KV-read part) of a decode solo step, seconds:
    attention, dispatch, link, poll, the FFN item and its GEMMs, the reply, the combine."""
    cached = p.batch * (p.context + p.output_len / 2)  # the closed loop's mean over a request's life
    attn_all = cm.attention_time(base, p.batch, 0.0, cached, p.attn_share)
    kv = attn_all - cm.attention_time(base, p.batch, 0.0, 0.0, p.attn_share)
    nbytes = cm.wire_rows(shape, p.batch, p.num_ffn, "pair") * shape.row_bytes
    fixed = (attn_all - kv + base.dispatch_fixed_s + base.combine_fixed_s + base.ffn_item_s + base.ffn_poll_s
             + 2 * link.time_s(nbytes) + cm.expert_gemm_time(base, shape, p.batch, p.num_ffn, p.ffn_share))
    return fixed, kv


def fit_decode_costs(shape: ModelShape, points: list, base: cm.Costs, link: Link) -> cm.Costs:
    """``base`` fitted so that one decode replica alone reproduces ``points`` (solo time per
    output token). A solo step of L layers, each a device chain ``c = fixed + e + k x kv``
    (``e``: an FFN host cost per item, ``k``: the KV-read scale) whose layer ``l`` the host
    issues by ``(l + 1) h`` (``h``: the Attention host per layer), lasts
    ``max(h + L c, L h + c)``: the chain, or the host with the last layer's chain after it.
    (h, e, k) minimize the squared relative errors on grids (HOST_GRID, KV_SCALES); only solo
    steps enter, so the multi-replica rows validate. Where the points carry the FFN's busy
    time per item in their solo windows, the expert GEMM time is set to it first (one scale
    on both GEMM rates, :func:`_fit_ffn_service`)."""
    if not points:
        raise ConfigError("fit_decode_costs needs at least one solo point (bench_decode with --solo-duration > 0)")
    base, gemm_note = _fit_ffn_service(shape, points, base)
    parts = np.array([_decode_parts(shape, base, link, p) for p in points])  # [n, 2]
    y = np.array([p.solo_step_s for p in points])
    h = np.array(HOST_GRID)[:, None, None, None]
    e = np.array(HOST_GRID)[None, :, None, None]
    k = np.array(KV_SCALES)[None, None, :, None]
    L = shape.layers
    chain = parts[:, 0] + e + k * parts[:, 1]
    step = np.maximum(h + L * chain, L * h + chain)
    err = np.sum(((step - y) / y) ** 2, axis=-1)
    ih, ie, ik = np.unravel_index(int(np.argmin(err)), err.shape)
    h_s, e_s, k_s = HOST_GRID[ih], HOST_GRID[ie], KV_SCALES[ik]
    return base.replace(attn_host_s=h_s, ffn_item_s=base.ffn_item_s + e_s,
                        attn_per_ctx_token_s=base.attn_per_ctx_token_s * k_s,
                        source=f"{base.source}; fitted to {len(points)} decode solo steps: Attention host "
                               f"{h_s * 1e6:.0f} us/layer, FFN host +{e_s * 1e6:.0f} us/item, KV reads x{k_s:.3g}"
                               f"{gemm_note}")


def _fit_ffn_service(shape: ModelShape, points: list, base: cm.Costs) -> tuple:
    """(``base`` with its expert GEMM rates scaled so that the GEMM time of the points' items
    is the FFN busy time per item measured in their solo windows, a note for the source);
    ``base`` unchanged where no point measured it. The solo step alone cannot split a layer's
    chain between the attention and the FFN; the FFN's own busy time can, and it is what a
    saturated FFN's throughput rests on."""
    measured = [p for p in points if p.ffn_busy_per_item_s and p.ffn_busy_per_item_s > 0]
    if not measured:
        return base, ""
    model = [cm.expert_gemm_time(base, shape, p.batch, p.num_ffn, p.ffn_share) for p in measured]
    scale = float(np.mean([p.ffn_busy_per_item_s for p in measured]) / np.mean(model))
    fitted = base.replace(gemm_tflops=base.gemm_tflops / scale, weight_read_gbps=base.weight_read_gbps / scale)
    mean_us = np.mean([p.ffn_busy_per_item_s for p in measured]) * 1e6
    return fitted, f", expert GEMMs x{scale:.3g} (the FFN's busy {mean_us:.0f} us per item in the solo windows)"

