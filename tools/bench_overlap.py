"""bench_afd's overlap variants (issue #15, items 3 and 4): ``--overlap {none,attn,ffn,both,all}``.

- ``none``: today's batch: per layer attention, send, ``recv_ffn_output(blocking=False)`` on
  one stream; ``FFNWorker`` replies inline.
- ``attn``: the Attention replica runs its batch as **two micro-batch stages** (the protocol's
  ``stage_idx``; every rank's ``ConnectorConfig`` has ``async_moe_ubatching=True``,
  ``async_moe_num_ubatches=2``, so each stage has its own ring): stage 0 = the first half of
  the batch's requests, stage 1 = the rest. Per layer, stage by stage: receive the stage's
  previous layer (``blocking=False``), attention, router, gate, send. Stage 0 is issued on the
  replica's current stream and stage 1 on a second stream (cuda), so the attention of one half
  runs while the other half's FFN round trip is in flight: the standard two-micro-batch
  pipeline. The streams meet only through CUDA events (the side stream waits for the main one
  at the start of a batch, the main one for the side one before the batch's single
  synchronization, ``conn.check_errors()``, which synchronizes the current stream); no host
  synchronization inside a layer, so the batch is capturable in a CUDA graph like the
  one-stage one. On the host backend both stages run on the calling thread in the same order
  (the FFN process still serves one half while the other's attention runs).
- ``ffn``: ``FFNWorker(overlap=True)``: item i's reply on a communication stream while item
  i+1's arrival handling and GEMMs proceed (``afd_cupy.ffn.overlap``).
- ``both``: ``attn`` and ``ffn``.
- ``all``: one launch per variant and schedule, in the same run; the gain of each variant =
  its tokens/s / ``none``'s tokens/s, per (workload, schedule); target (issue #15) >= 1.10 for
  ``attn`` and ``ffn`` on the uniform workload, reported, never asserted.

NOTE: splitting a batch by requests keeps each request's causal attention intact, so the two
variants do the same work; a batch needs at least 2 requests (with ``--overlap`` other than
``none`` bench_afd's default is 2 requests of half the usual uniform length: the same tokens).
"""
from __future__ import annotations

import contextlib

import bench_common as bc

VARIANTS = ("none", "attn", "ffn", "both")
CHOICES = VARIANTS + ("all",)
GAIN_TARGET = 1.10
NUM_STAGES = 2


def uses_attn(variant: str) -> bool:
    return variant in ("attn", "both")


def uses_ffn(variant: str) -> bool:
    return variant in ("ffn", "both")


def connector_config(variant: str):
    """Every rank's ``ConnectorConfig`` for ``variant`` (two stages when the Attention side
    pipelines; the handshake requires the same config on every rank)."""
    from afd_cupy.config import ConnectorConfig

    if uses_attn(variant):
        return ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches=NUM_STAGES)
    return ConnectorConfig()


def split_requests(lengths) -> tuple[tuple, tuple]:
    """(stage 0's request lengths, stage 1's): the first ceil(n / 2) requests, the rest.
    Raises ValueError for fewer than 2 requests (a request is never cut: causal attention)."""
    lengths = tuple(lengths)
    if len(lengths) < NUM_STAGES:
        raise ValueError(f"the two-stage pipeline splits a batch by requests; got {len(lengths)} "
                         "request(s): use --requests >= 2")
    half = (len(lengths) + 1) // 2
    return lengths[:half], lengths[half:]


class TwoStages:
    """The two streams of a pipelined replica: stage 0 on the stream current at construction,
    stage 1 on a new one (cuda); no streams on the CPU."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.on_cuda = getattr(device, "type", None) == "cuda"
        self.streams = (torch.cuda.current_stream(device), torch.cuda.Stream(device)) if self.on_cuda else None

    def on(self, stage: int):
        return self.torch.cuda.stream(self.streams[stage]) if self.on_cuda else contextlib.nullcontext()

    def fork(self) -> None:
        """Stage 1's stream waits for what the main stream queued (the batch input)."""
        if self.on_cuda:
            self.streams[1].wait_stream(self.streams[0])

    def join(self) -> None:
        """The main stream waits for stage 1's stream (then one synchronization covers both)."""
        if self.on_cuda:
            self.streams[0].wait_stream(self.streams[1])


def pipelined_batch(conn, replica, x, lengths, stages: TwoStages, recorder=None, batch_idx: int = 0):
    """All layers of one batch as two micro-batch stages (module doc); one synchronization at
    the end (``conn.check_errors()``). ``x``: [T, H] bf16, rows in request order; returns the
    final hidden states as (stage 0's rows, stage 1's rows): the input order, not concatenated
    (no copy the one-stage batch does not make).

    ``recorder`` (timeline runs; ``bench_spans.SpanRecorder``): stage s's spans on lane
    ``bench_spans.stage_lane(s)``, tagged ``(batch_idx, layer)``."""
    import bench_spans as spans

    halves_len = split_requests(lengths)
    split = sum(halves_len[0])
    hidden = [x[:split], x[split:]]
    pending = [None, None]
    stages.fork()
    for layer_idx in range(replica.dims.layers):
        for stage in range(NUM_STAGES):
            lane = spans.stage_lane(stage)
            with stages.on(stage):
                h = hidden[stage]
                if pending[stage] is not None:
                    if recorder is not None:
                        recorder.mark(lane, "combine", (batch_idx, layer_idx - 1))
                    h = h + conn.recv_ffn_output(pending[stage], blocking=False)
                if recorder is not None:
                    recorder.mark(lane, "attention", (batch_idx, layer_idx))
                h = h + replica.attention(layer_idx, h, halves_len[stage])
                normed, logits = replica.router_input(layer_idx, h)
                weights, ids = conn.select_experts(logits)
                if recorder is not None:
                    recorder.mark(lane, "dispatch", (batch_idx, layer_idx))
                pending[stage] = conn.send_attn_output(normed, ids, weights, layer_idx, stage)
                hidden[stage] = h
    last = replica.dims.layers - 1
    for stage in range(NUM_STAGES):
        with stages.on(stage):
            if recorder is not None:
                recorder.mark(spans.stage_lane(stage), "combine", (batch_idx, last))
            hidden[stage] = hidden[stage] + conn.recv_ffn_output(pending[stage], blocking=False)
            if recorder is not None:
                recorder.mark(spans.stage_lane(stage), None)
    stages.join()
    conn.check_errors()
    return tuple(hidden)


# --------------------------------------------------------------------------- report

def gains(rows: list) -> list:
    """Per (workload, schedule) measured with ``none``: every variant's tokens/s and gain =
    tokens/s / none's tokens/s, with the inputs (mean batch ms per replica, FFN busy)."""
    out = []
    base = {(r["workload"], r["schedule"]): r for r in rows if r["overlap"] == "none"}
    for (workload, schedule), none in base.items():
        entry = {"workload": workload, "schedule": schedule, "none_tokens_per_s": none["tokens_per_s"],
                 "variants": {}}
        for r in rows:
            if (r["workload"], r["schedule"]) != (workload, schedule):
                continue
            entry["variants"][r["overlap"]] = {
                "tokens_per_s": r["tokens_per_s"],
                "gain": r["tokens_per_s"] / none["tokens_per_s"] if none["tokens_per_s"] > 0 else float("nan"),
                "batch_mean_ms": [rep["batch_mean_ms"] for rep in r["replicas"]],
                "latency_p50_ms": [rep["latency_p50_ms"] for rep in r["replicas"]],
                "ffn_busy_fraction": r["ffn"]["busy_fraction"]}
        out.append(entry)
    return out


def gain_targets(entries: list) -> list:
    """Issue #15: each overlap >= +10 % on the uniform workload (every schedule measured)."""
    targets = []
    for entry in entries:
        if entry["workload"] != "uniform":
            continue
        for variant in ("attn", "ffn", "both"):
            measured = entry["variants"].get(variant, {}).get("gain")
            if measured is None and variant == "both":
                continue
            targets.append(bc.target_row(f"overlap {variant} / none tokens/s, uniform, {entry['schedule']}",
                                         f">= {GAIN_TARGET}x", measured, "x", lambda v: v >= GAIN_TARGET,
                                         note="issue #15" + (" items 3+4" if variant == "both" else "")))
    return targets


def gains_table(entries: list) -> str:
    """One row per (workload, schedule, variant): tokens/s, gain, batch ms, FFN busy."""
    rows = []
    for entry in entries:
        for variant in VARIANTS:
            v = entry["variants"].get(variant)
            if v is None:
                continue
            rows.append((entry["workload"], entry["schedule"], variant, v["tokens_per_s"], v["gain"],
                         " / ".join(f"{m:.3g}" for m in v["batch_mean_ms"]), v["ffn_busy_fraction"]))
    return bc.format_table(("workload", "schedule", "overlap", "total tok/s", "gain vs none",
                            "batch ms per replica", "FFN busy"), rows)
