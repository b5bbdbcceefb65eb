"""The graph-driven FFN's protocol words, its numpy references and its bucket policy
(docs/design/cuda-graphs.md). Pure Python and numpy: no CuPy, no GPU.

One CUDA graph per size bucket serves one work item per replay with no host step:
``afd_graph_wait_stage`` (the wait and the stage in one kernel; or ``afd_wait_any`` into a
device doorbell, then ``afd_graph_stage``) -> ``afd_graph_gather`` ->
grouped GEMMs over every layer's experts stacked into one problem list -> ``afd_graph_reply``;
in the dedup wire mode ``afd_graph_dedup_expand`` and ``afd_graph_dedup_reply`` (the expand with
its route-table check, the fused reduce) replace the gather and the reply.
The stage kernel decides what a replay does (``GS_*``), and this module holds the same decision
in numpy (:func:`stage_reference`), built from :mod:`afd_cupy.wire`'s own rules
(``decode_header``, ``reply_header``), so the kernel is checked against the protocol's one
home; the dedup kernels' references (:func:`dedup_expand_reference`,
:func:`dedup_reply_reference`) are built from :mod:`afd_cupy.testing.dedup_reference`, and
:func:`route_verdict` turns a GS_BAD_ROUTE record into the eager path's WireError. The cuda
server is :mod:`afd_cupy.backends.cuda_ffn_graph`.

Words mirrored from ``raw_kernels/ffn/ffn_graph.cuh`` (a CPU test parses the .cuh):
``GS_*`` (what a replay did), ``STATE_*`` (device state, stage -> gather/reply) and ``REC_*``
(one record per replay in a pinned ring the host reads after the replay's event).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from afd_cupy import wire
from afd_cupy.errors import ConfigError, WireError
from afd_cupy.wire.seq import next_seq

GS_IDLE = 0      # wait_any timed out: nothing consumed
GS_SERVED = 1    # computed and answered inside the graph
GS_SHUTDOWN = 2  # a shutdown message was consumed
GS_EAGER = 3     # valid, but not for this graph (bucket, layer): the host serves it eagerly
GS_REJECTED = 4  # a header check failed: the host decodes it and raises
GS_BAD_ROUTE = 5  # dedup: the route table failed a check; the verdict is in the record
GS_NAMES = {GS_IDLE: "IDLE", GS_SERVED: "SERVED", GS_SHUTDOWN: "SHUTDOWN", GS_EAGER: "EAGER",
            GS_REJECTED: "REJECTED", GS_BAD_ROUTE: "BAD_ROUTE"}

STATE_ACTIVE = 0
STATE_SLOT = 1
STATE_REGION = 2
STATE_RING = 3
STATE_ROUTED = 4
STATE_SHARED = 5
STATE_SEQ = 6
STATE_CHUNK = 7
STATE_RECORD = 8  # address of the replay's record (the dedup expand writes its verdict there)
STATE_HEADER = 9  # reply header int32 words from this int64 word on

REC_REPLAY = 0
REC_STATUS = 1
REC_SLOT = 2
REC_FLAG = 3
REC_SEQ = 4
REC_DETAIL = 5
REC_HEADER = 6  # dispatch header int32 words from this int64 word on

#: groups of one torch._grouped_mm problem list (fewer than 1024 on its CUTLASS path)
MAX_GROUPS = 1023


def state_words(header_words: int) -> int:
    """int64 words of the device state for ``header_words`` header words."""
    return STATE_HEADER + -(-header_words // 2)


def record_words(header_words: int, dedup: bool = False) -> int:
    """int64 words of one replay record, rounded up to 8 (64-byte records); ``dedup``: room for
    the route-table verdict after the header words (:func:`verdict_offset`)."""
    used = verdict_offset(header_words) + (wire.STATUS_WORDS if dedup else 0)
    return -(-used // 8) * 8


def verdict_offset(header_words: int) -> int:
    """int64 word of a record where a GS_BAD_ROUTE verdict (a status block) starts."""
    return REC_HEADER + -(-header_words // 2)


def route_verdict(record: np.ndarray, layout: wire.WindowLayout) -> WireError:
    """The WireError of a GS_BAD_ROUTE record (int64 [record_words]): the verdict
    ``afd_graph_dedup_expand`` wrote, decoded by ``wire.route_table_error`` exactly as the eager
    path decodes ``afd_dedup_expand``'s status record (same message)."""
    if int(record[REC_STATUS]) != GS_BAD_ROUTE:
        raise ValueError(f"record status {GS_NAMES.get(int(record[REC_STATUS]))} is not BAD_ROUTE")
    words = record[REC_HEADER:].view(np.int32)[:layout.header_words]
    start = verdict_offset(layout.header_words)
    status = wire.StatusRecord.decode(record[start:start + wire.STATUS_WORDS])
    return wire.route_table_error(status, shared_tokens=int(words[wire.HDR_SHARED_TOKENS]))


# --------------------------------------------------------------------------- layer chunks

def layers_per_chunk(num_layers: int, expert_per_rank: int) -> int:
    """Layers whose experts share one grouped-GEMM problem list (fewer than 1024 groups).

    Raises ConfigError when one layer's experts alone do not fit."""
    if expert_per_rank > MAX_GROUPS:
        raise ConfigError(f"expert_per_rank={expert_per_rank} > {MAX_GROUPS}: one layer's experts do "
                          "not fit one torch._grouped_mm problem list")
    return max(1, min(num_layers, MAX_GROUPS // expert_per_rank))


def num_chunks(num_layers: int, expert_per_rank: int) -> int:
    """Grouped GEMMs (pairs: gate/up and down) per replay: one per layer chunk."""
    per = layers_per_chunk(num_layers, expert_per_rank)
    return -(-num_layers // per)


def routed_offsets_reference(counts, layer: int | None, num_layers: int,
                             expert_per_rank: int) -> np.ndarray:
    """int32 [num_layers * epr]: what ``afd_graph_stage`` writes as ``routed_offs``.

    Group g = l * epr + e of the stacked problem list (layer-major); layer chunk c holds layers
    [c * lpc, (c + 1) * lpc) (:func:`layers_per_chunk`), and its offsets are the cumulative END
    rows of its groups, as ``torch._grouped_mm(offs=)`` takes them. The arrived ``layer``'s chunk:
    0 for the layers before it (empty groups), ``cumsum(counts)`` for it, ``sum(counts)`` for
    the layers after it (empty groups). Every other chunk, and ``layer=None`` (nothing served):
    all 0, so every group is empty and the GEMM does no work.
    """
    lpc = layers_per_chunk(num_layers, expert_per_rank)
    offs = np.zeros((num_layers, expert_per_rank), np.int32)
    if layer is None:
        return offs.ravel()
    counts = np.asarray(counts, np.int64)
    chunk = layer // lpc
    in_chunk = np.arange(num_layers) // lpc == chunk
    offs[in_chunk & (np.arange(num_layers) > layer)] = int(counts.sum())
    offs[layer] = np.cumsum(counts)
    return offs.ravel()


def shared_offsets_reference(shared_rows: int, layer: int | None, num_layers: int) -> np.ndarray:
    """int32 [num_layers]: the shared experts' offsets (one group per layer; one chunk)."""
    offs = np.zeros(num_layers, np.int32)
    if layer is not None:
        offs[layer:] = shared_rows
    return offs


# --------------------------------------------------------------------------- the stage decision

@dataclass(frozen=True)
class StageResult:
    """What ``afd_graph_stage`` decides for one replay (the reference's output).

    ``status``: GS_*; ``detail``: the failing header word (REJECTED) or -1; ``seq``: the reply
    seq used (SERVED) or reserved (EAGER), else 0; ``reply_words``: int32 header words of the
    reply (``wire.reply_header``) when SERVED, else None; ``routed_offs`` / ``shared_offs``:
    the offsets written; ``chunk``: layer chunk of a served layer, else -1.
    """

    status: int
    detail: int
    seq: int
    reply_words: np.ndarray | None
    routed_offs: np.ndarray
    shared_offs: np.ndarray
    chunk: int


def stage_reference(words, *, region: int | None, layout: wire.WindowLayout, src_rank: int,
                    num_attn_ranks: int, num_layers: int, routed_bucket: int,
                    shared_bucket: int, prev_seq: int) -> StageResult:
    """The stage kernel's decision for one replay, from the protocol's own rules.

    ``words``: the header as consumed (int32) or ignored when ``region`` is None (wait_any
    timed out). ``prev_seq``: the slot's reply seq before this replay. REJECTED is whatever
    ``wire.decode_header`` (with the layout's capacities) raises for, a dispatch whose row
    format is not the layout's (``wire.dispatch_rows_fault``: FP8 rows to a payload connector
    or the reverse; ``detail`` HDR_FLAGS), and a ``src_rank`` that is not its region (the
    connector's ProtocolError); ``detail`` is not modelled otherwise (the kernel's word index
    is checked by the cuda tests only through the host's decode).
    """
    epr = layout.expert_per_rank
    idle = StageResult(GS_IDLE, -1, 0, None, routed_offsets_reference(None, None, num_layers, epr),
                       shared_offsets_reference(0, None, num_layers), -1)
    if region is None:
        return idle
    try:
        header = wire.decode_header(np.asarray(words, np.int32), epr, layout)
    except WireError:
        return _replace(idle, status=GS_REJECTED)
    if wire.dispatch_rows_fault(header.flags, layout) is not None:  # rows of the other format
        return _replace(idle, status=GS_REJECTED, detail=wire.HDR_FLAGS)
    if header.is_shutdown:
        return _replace(idle, status=GS_SHUTDOWN)
    if header.src_rank != region or region >= num_attn_ranks:
        return _replace(idle, status=GS_REJECTED, detail=wire.HDR_SRC_RANK)
    seq = next_seq(prev_seq)  # the reply seq the stage reserves (afd_cupy.wire.seq)
    if not 0 <= header.layer_idx < num_layers or header.routed_tokens > routed_bucket \
            or header.shared_tokens > shared_bucket:
        return _replace(idle, status=GS_EAGER, seq=seq)
    reply = wire.reply_header(header, seq=seq, src_rank=src_rank)
    return StageResult(
        GS_SERVED, -1, seq, wire.encode_header(reply, epr),
        routed_offsets_reference(header.expert_counts, header.layer_idx, num_layers, epr),
        shared_offsets_reference(header.shared_tokens, header.layer_idx, num_layers),
        header.layer_idx // layers_per_chunk(num_layers, epr))


def _replace(result: StageResult, **changes) -> StageResult:
    return StageResult(**{**result.__dict__, **changes})


# --------------------------------------------------------------------------- dedup kernels

def dedup_expand_reference(route_table: np.ndarray, rows: np.ndarray, *, num_tokens: int,
                           routed_tokens: int, shared_tokens: int):
    """What ``afd_graph_dedup_expand`` leaves for a served dedup item: ``(verdict, staging,
    shared)``.

    ``route_table`` int32 [R, W] and ``rows`` [R, H] (raw words) as received. ``verdict``:
    ``dedup_reference.expand_verdict_reference`` (None: accepted; else ``(rule, row, column,
    expected, observed)``, written into the record with GS_BAD_ROUTE); ``staging`` [P, H]: the
    grouped rows (``expand_reference``; the GEMM's input), None for a rejected table; ``shared``
    [S, H]: the shared experts' input, ``rows[:S]``. The route-table copy is ``route_table``."""
    from afd_cupy.testing import dedup_reference as ref

    verdict = ref.expand_verdict_reference(route_table, num_tokens=num_tokens,
                                           routed_tokens=routed_tokens, shared_tokens=shared_tokens)
    staging = None if verdict is not None else ref.expand_reference(route_table, rows, routed_tokens)
    return verdict, staging, np.array(rows[:shared_tokens])


def dedup_reply_reference(route_table: np.ndarray, routed_out, shared_out, *,
                          rows: np.ndarray | None = None) -> np.ndarray:
    """fp32 [R, H]: the rows ``afd_graph_dedup_reply`` writes before rounding once to the
    payload dtype (``dedup_reference.reduce_reference``: fp32 in slot order, no FMA).

    ``routed_out`` [>= P, H] / ``shared_out`` [>= S, H] (any float dtype, the GEMM outputs in
    staging order), or both None for identity experts: then ``rows`` (the received rows, fp32)
    stand for both (every slot of row r reads row r; shared rows add row r once)."""
    from afd_cupy.testing import dedup_reference as ref

    top_k = (route_table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    slots = route_table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k]
    routed_tokens = int((slots >= 0).sum())
    shared_tokens = int(route_table[:, wire.ROUTE_SHARED].sum())
    if routed_out is None:
        routed_out = ref.expand_reference(route_table, np.asarray(rows, np.float32), routed_tokens)
        shared_out = rows
    shared = None if shared_tokens == 0 or shared_out is None else np.asarray(shared_out)[:shared_tokens]
    return ref.reduce_reference(route_table, np.asarray(routed_out)[:routed_tokens], shared)


# --------------------------------------------------------------------------- buckets

@dataclass(frozen=True)
class Bucket:
    """Rows one graph serves: ``routed_rows`` (grouped-GEMM staging) and ``shared_rows``;
    ``rows``: the message rows its dedup row kernels are sized for (a grid hint: they stride
    over any count; 0 in pair mode)."""

    routed_rows: int
    shared_rows: int
    rows: int = 0

    def fits(self, routed: int, shared: int) -> bool:
        return routed <= self.routed_rows and shared <= self.shared_rows


def buckets_for_tokens(token_counts, layout: wire.WindowLayout, *, top_k: int,
                       num_ffn_ranks: int) -> tuple:
    """One :class:`Bucket` per batch size in ``token_counts``, ascending, deduplicated: the
    most rows a batch of that many tokens can bring one FFN rank (every partial on this rank:
    ``t * top_k``; shared slice ``ceil(t / F)``), clipped at the window's capacities.

    Dedup layouts (docs/design/dedup.md): a rank gets at most one row per token (``rows = t``)
    and may run every one of those tokens' shared experts (shared ``t``, not ``ceil(t / F)``);
    the staging still holds up to ``t * top_k`` partials."""
    if not token_counts or min(token_counts) < 1:
        raise ConfigError(f"bucket token counts must be >= 1, got {token_counts}")
    if layout.is_dedup:
        found = {Bucket(min(layout.routed_cap, t * top_k), min(layout.shared_cap, t),
                        min(layout.token_cap, t)) for t in token_counts}
    else:
        found = {Bucket(min(layout.routed_cap, t * top_k),
                        min(layout.shared_cap, -(-t // num_ffn_ranks))) for t in token_counts}
    return tuple(sorted(found, key=lambda b: (b.routed_rows, b.shared_rows, b.rows)))


def identity_bucket(layout: wire.WindowLayout) -> Bucket:
    """The one bucket of identity experts (no GEMM staging): the window's capacities."""
    return Bucket(layout.routed_cap, layout.shared_cap, layout.token_cap if layout.is_dedup else 0)


def choose_bucket(buckets, routed: int, shared: int) -> int | None:
    """Index of the smallest bucket (``buckets`` ascending) holding an item of ``routed`` and
    ``shared`` rows, or None when none does (the eager path serves it)."""
    for idx, bucket in enumerate(buckets):
        if bucket.fits(routed, shared):
            return idx
    return None


class BucketPolicy:
    """Which bucket's graph the host replays next: the smallest one that held every item of the
    last ``window`` items (a decode batch size is stable over many layers). An item that did
    not fit went eager; it moves the choice up at once, while moving down waits ``window``
    items. Host bookkeeping only: no device access."""

    def __init__(self, buckets, window: int = 64):
        if not buckets:
            raise ConfigError("at least one bucket is needed")
        self.buckets = tuple(buckets)
        self.window = window
        self._recent: list = []
        self.current = 0

    def observe(self, routed: int, shared: int) -> None:
        self._recent.append((routed, shared))
        if len(self._recent) > self.window:
            del self._recent[0]
        routed_max = max(r for r, _ in self._recent)
        shared_max = max(s for _, s in self._recent)
        idx = choose_bucket(self.buckets, routed_max, shared_max)
        self.current = len(self.buckets) - 1 if idx is None else idx
