"""The graph FFN server's device state and CUDA graphs (docs/design/cuda-graphs.md): one
graph per size bucket, captured over the FFN path's arrival detection
(:class:`~afd_cupy.backends.cuda_ffn.GraphResources`, from the path's public
``graph_resources()``) and the server's own buffers. The host loop that replays them is
:mod:`afd_cupy.backends.cuda_ffn_graph`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import kernels, moe, wire
from afd_cupy.backends.cuda_ffn_dedup import UNCLAIMED
from afd_cupy.errors import ConfigError
from afd_cupy.ffn import graph as ffn_graph
from afd_cupy.ffn.worker import per_layer
from afd_cupy.kernels import specs
from afd_cupy.moe import stream_gemm


#: the graph's expert GEMMs (GraphFFNServer(expert_gemm=...)): torch's grouped GEMMs (the
#: default) or moe.stream_gemm's Triton kernels (decision 0032)
EXPERT_GEMMS = ("grouped_mm", "stream")


@dataclass(frozen=True)
class StackedWeights:
    """Every layer's experts stacked for the graph's grouped GEMMs: ``w13``
    ``[num_layers * epr, 2I, H]``, ``w2`` ``[num_layers * epr, H, I]`` (bf16; E4M3 with
    ``w13_scale`` / ``w2_scale`` fp32 ``[num_layers * epr, 2I / H]`` for FP8 experts, which only
    ``expert_gemm="stream"`` runs), ``activation`` the layer-0 experts whose options the
    activation uses; the shared experts likewise (bf16, ``[num_layers, ...]``) or None."""

    w13: torch.Tensor
    w2: torch.Tensor
    activation: object
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    shared_activation: object = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def routed(self, groups: slice):
        """The stacked routed experts of ``groups`` as one weights object of the layer-0 kind
        (``moe.ExpertWeights`` or ``moe.FP8ExpertWeights``; views, no copy)."""
        fields = {"w13": self.w13[groups], "w2": self.w2[groups]}
        if self.w13_scale is not None:
            fields.update(w13_scale=self.w13_scale[groups], w2_scale=self.w2_scale[groups])
        return dataclasses.replace(self.activation, num_experts=fields["w13"].shape[0], **fields)

    def shared(self):
        """The stacked shared experts (one group per layer) as one ``moe.ExpertWeights``."""
        return dataclasses.replace(self.shared_activation, w13=self.shared_w13, w2=self.shared_w2,
                                   num_experts=self.shared_w13.shape[0])


def stack_weights(experts, shared, num_layers: int, epr: int, device, expert_gemm: str = "grouped_mm"):
    """Stacked copies of every layer's weights, and per-layer views of them for the eager
    worker: ``(StackedWeights, views, shared_views)``. ConfigError for what the graph's
    GEMM mode (``expert_gemm``, :data:`EXPERT_GEMMS`) cannot run: FP8 routed experts run with
    ``"stream"`` only."""
    routed = per_layer(experts, num_layers)
    fused = per_layer(shared, num_layers)
    first = routed[0]
    fp8 = [isinstance(w, moe.FP8ExpertWeights) for w in routed]
    if any(fp8) and (expert_gemm != "stream" or not all(fp8)):
        raise ConfigError("the graph FFN runs FP8 experts (moe.FP8ExpertWeights) only with "
                          "GraphFFNServer(expert_gemm='stream'), every layer FP8; serve them with "
                          "FFNWorker (its Python loop) otherwise")
    bf16 = [s for s in fused if s] + ([] if any(fp8) else routed)
    if any(w.dtype != torch.bfloat16 for w in bf16) or any(w.has_bias for w in routed + [s for s in fused if s]):
        raise ConfigError("the graph FFN's GEMM mode needs bf16 experts (or FP8 routed experts with "
                          "expert_gemm='stream') without biases")
    if any(s is not None and s.gate is not None for s in fused):
        raise ConfigError("the graph FFN does not run a shared-expert gate yet")
    names = ("w13", "w2", "w13_scale", "w2_scale") if any(fp8) else ("w13", "w2")
    cat = {n: torch.cat([getattr(w, n) for w in routed]).contiguous() for n in names}
    views = [dataclasses.replace(w, **{n: t[l * epr:(l + 1) * epr] for n, t in cat.items()})
             for l, w in enumerate(routed)]
    scales = {"w13_scale": cat.get("w13_scale"), "w2_scale": cat.get("w2_scale")}
    stacked = StackedWeights(cat["w13"], cat["w2"], first, **scales)
    shared_views = fused
    if fused[0] is not None:
        shared_w13 = torch.cat([s.w13 for s in fused]).contiguous()
        shared_w2 = torch.cat([s.w2 for s in fused]).contiguous()
        shared_views = [dataclasses.replace(s, w13=shared_w13[l:l + 1], w2=shared_w2[l:l + 1])
                        for l, s in enumerate(fused)]
        stacked = StackedWeights(cat["w13"], cat["w2"], first, shared_w13, shared_w2, fused[0], **scales)
    if expert_gemm == "grouped_mm" and not moe.grouped_mm_supported(
            torch.empty(8, first.hidden_size, dtype=torch.bfloat16, device=device), views[0]):
        raise ConfigError("the graph FFN's GEMM mode needs torch._grouped_mm (SM90/SM100, "
                          "bf16, 16-byte aligned operands)")
    return stacked, views, shared_views


class GraphCapture:
    """The device state of a graph FFN server and the capture of its graphs.

    ``res``: the FFN path's :class:`~afd_cupy.backends.cuda_ffn.GraphResources`; ``layout``,
    ``model``, ``torch_dtype``, ``device``: the connector's; ``weights``: a
    :class:`StackedWeights` (None with ``identity``); the rest as ``GraphFFNServer``'s
    arguments. Allocates every buffer now (zero-filled, synchronized); :meth:`capture` builds
    one bucket's graph. Public buffers the host loop reads: ``records`` (pinned ring of
    ``num_records`` records of ``record_words`` words) and ``reply_seqs`` (cupy int64
    [num_slots], the device's reply seqs while the server runs).
    """

    def __init__(self, res, *, layout, model, torch_dtype, device, depth: int,
                 idle_timeout_s: float, fused_wait_stage: bool, identity: bool,
                 gemm_sm_carveout: int, weights: StackedWeights | None, expert_gemm: str = "grouped_mm"):
        self.res, self.layout, self.model = res, layout, model
        self.torch_dtype, self.device = torch_dtype, device
        self.depth, self.idle_timeout_s = depth, idle_timeout_s
        self.fused_wait_stage, self.identity = fused_wait_stage, identity
        self.gemm_sm_carveout, self.weights = gemm_sm_carveout, weights
        self.expert_gemm = expert_gemm
        self.is_dedup = layout.is_dedup
        # FP8 dispatch (pair mode): the gather decodes the slot's FP8 rows into the staging rows,
        # with identity experts too (their reply then reads the decoded rows)
        self.fp8_rows = layout.is_fp8_dispatch
        self.num_layers = model.num_layers
        self.lpc = ffn_graph.layers_per_chunk(self.num_layers, layout.expert_per_rank)
        self.num_chunks = ffn_graph.num_chunks(self.num_layers, layout.expert_per_rank)
        self._graph_buffers: list = []
        self._alloc_device_state()

    def _alloc_device_state(self) -> None:
        res, layout = self.res, self.layout
        cp = res.cp
        hw = layout.header_words
        self.doorbell = cp.zeros(wire.DB_HEADER + -(-hw // 2), cp.int64)  # device, not pinned
        self.state = cp.zeros(ffn_graph.state_words(hw), cp.int64)
        self.reply_seqs = cp.zeros(layout.num_slots, cp.int64)
        self.replay_counter = cp.zeros(1, cp.int64)
        self.num_records = 2 * self.depth
        self.record_words = ffn_graph.record_words(hw, dedup=self.is_dedup)
        self.records = kernels.PinnedInt64(self.num_records * self.record_words)
        self.routed_offs = cp.zeros(self.num_layers * layout.expert_per_rank, cp.int32)
        has_shared = self.model.num_shared_experts > 0 and not self.identity
        self.shared_offs = cp.zeros(self.num_layers, cp.int32) if has_shared else None
        self.peer_windows = cp.asarray(res.attention_windows, dtype=cp.uint64)
        self.reply_done = cp.zeros(1, cp.uint32)
        if self.is_dedup:  # afd_graph_dedup_expand: the checked route-table copy and its scratch
            # NOTE: one copy for every bucket: replays run one after another on the server's stream
            self.route_copy = cp.zeros((max(1, layout.token_cap), layout.route_width), cp.int32)
            self.expand_claims = cp.full(max(1, layout.routed_cap), UNCLAIMED, cp.int32)
            self.expand_fault = cp.full(1, np.iinfo(np.uint64).max, cp.uint64)
            self.expand_claimed = cp.zeros(1, cp.uint32)
            self.expand_done = cp.zeros(1, cp.uint32)
        # torch views made here, not inside a capture (__cuda_array_interface__ carries a stream)
        self.routed_offs_t = self._as_torch(self.routed_offs)
        self.shared_offs_t = None if self.shared_offs is None else self._as_torch(self.shared_offs)
        self.wait_launch = kernels.PackedLaunch(kernels.wait_any_spec(
            window=res.own_window, geo=res.geometry, last_seen=res.last_seen,
            scan_start=res.scan_start, counts_snapshot=res.counts_snapshot,
            timeout_ns=int(self.idle_timeout_s * 1e9), doorbell=self.doorbell.data.ptr, ticket=0))
        cp.cuda.Device(res.device_id).synchronize()

    def _as_torch(self, array) -> torch.Tensor:
        return torch.as_tensor(array, device=self.device)

    # --- capture ----------------------------------------------------------------------------
    def capture(self, bucket: ffn_graph.Bucket) -> torch.cuda.CUDAGraph:
        """Capture one bucket's graph. Every kernel goes to the capture stream (torch's current
        stream inside ``torch.cuda.graph``); buffers are allocated before, torch's own in the
        graph's pool; nothing synchronizes inside."""
        res, layout = self.res, self.layout
        hidden, dtype = layout.hidden_size, self.torch_dtype
        stage_args = dict(
            geo=res.geometry,
            expert_per_rank=layout.expert_per_rank, is_dedup=int(self.is_dedup), src_rank=res.src_rank,
            num_attn_ranks=res.num_attn_ranks, token_cap=layout.token_cap,
            routed_cap=layout.routed_cap, shared_cap=layout.shared_cap,
            routed_bucket=bucket.routed_rows, shared_bucket=bucket.shared_rows, is_fp8=int(self.fp8_rows),
            num_layers=self.num_layers, layers_per_chunk=self.lpc, routed_offs=self.routed_offs,
            shared_offs=0 if self.shared_offs is None else self.shared_offs.data.ptr,
            reply_seqs=self.reply_seqs, state=self.state, replay_counter=self.replay_counter,
            records=self.records.ptr, num_records=self.num_records, record_words=self.record_words)
        if self.fused_wait_stage:  # one kernel: the wait and the stage
            first = [kernels.PackedLaunch(specs.graph_wait_stage_spec(
                window=res.own_window, last_seen=res.last_seen, scan_start=res.scan_start,
                counts_snapshot=res.counts_snapshot, timeout_ns=int(self.idle_timeout_s * 1e9),
                **stage_args))]
        else:
            first = [self.wait_launch, kernels.PackedLaunch(specs.graph_stage_spec(
                doorbell=self.doorbell.data.ptr, **stage_args))]
        num_chunks = self.num_chunks
        routed_outs = res.cp.zeros(num_chunks, res.cp.uint64)
        keep = {"routed_outs": routed_outs}
        staged = not self.identity or self.fp8_rows  # the rows the GEMMs (or FP8 decoding) need
        if staged:
            has_shared = self.shared_offs is not None or (self.fp8_rows and self.model.num_shared_experts > 0)
            keep["x"] = torch.empty(max(1, bucket.routed_rows), hidden, dtype=dtype, device=self.device)
            keep["xs"] = (torch.empty(max(1, bucket.shared_rows), hidden, dtype=dtype, device=self.device)
                          if has_shared else None)
        staging = keep["x"].data_ptr() if staged else 0
        shared_staging = keep["xs"].data_ptr() if staged and keep["xs"] is not None else 0
        if self.is_dedup:
            gather, reply = self._dedup_launches(bucket, routed_outs, staging, shared_staging)
        else:
            reply = kernels.PackedLaunch(specs.graph_reply_spec(
                dtype_code=res.dtype_code, own_window=res.own_window, peer_windows=self.peer_windows,
                geo=res.geometry, src_rank=res.src_rank, state=self.state, routed_outs=routed_outs,
                shared_out=0, hidden_size=hidden, done_counter=self.reply_done,
                routed_bucket=bucket.routed_rows, shared_bucket=bucket.shared_rows, num_chunks=num_chunks))
            gather = None if not staged else kernels.PackedLaunch(specs.graph_gather_spec(
                dtype_code=res.dtype_code, window=res.own_window, geo=res.geometry,
                state=self.state, hidden_size=hidden, routed_staging=staging,
                shared_staging=shared_staging, routed_bucket=bucket.routed_rows,
                shared_bucket=bucket.shared_rows, fp8_rows=int(self.fp8_rows)))
        if not self.identity:
            side = torch.cuda.Stream(self.device)
            # warm-up: offsets are all 0, no GEMM work (with the capture's carve-out: the same
            # workspace sizes and kernels as the capture's)
            with torch.cuda.stream(side), moe.sm_carveout(self.gemm_sm_carveout):
                self._expert_ops(keep["x"], keep["xs"])
            side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            stream_ptr = torch.cuda.current_stream(self.device).cuda_stream
            for launch in first:  # wait + stage (one kernel or two)
                launch.launch(stream_ptr)
            if gather is not None:  # with identity experts too: dedup's expand (its check), an FP8 decode
                gather.launch(stream_ptr)
            if not self.identity:
                # the GEMMs' grids (SMs - carve-out CTAs) are read at launch: frozen in the graph
                with moe.sm_carveout(self.gemm_sm_carveout):
                    keep["outs"], keep["shared_out"] = self._expert_ops(keep["x"], keep["xs"])
                if keep["shared_out"] is not None:
                    reply.set("shared_out", keep["shared_out"].data_ptr())
            elif staged and keep["xs"] is not None:  # identity over decoded FP8 rows
                reply.set("shared_out", keep["xs"].data_ptr())
            reply.launch(stream_ptr)
        if not self.identity:  # the chunk outputs' addresses are fixed now: the reply reads them
            routed_outs.set(np.array([out.data_ptr() for out in keep["outs"]], np.uint64))
        elif staged:  # identity over decoded FP8 rows: every chunk answers with the staging rows
            routed_outs.set(np.full(self.num_chunks, keep["x"].data_ptr(), np.uint64))
        res.cp.cuda.Device(res.device_id).synchronize()
        self._graph_buffers.append(keep)  # the graph's buffers live as long as the server
        return graph

    def _dedup_launches(self, bucket: ffn_graph.Bucket, routed_outs, staging: int,
                        shared_staging: int):
        """(expand, reply) of one bucket's graph in the dedup wire mode, packed once."""
        res, layout = self.res, self.layout
        rows = bucket.rows or layout.token_cap
        expand = kernels.PackedLaunch(specs.graph_dedup_expand_spec(
            dtype_code=res.dtype_code, window=res.own_window, geo=res.geometry, state=self.state,
            top_k=layout.top_k, hidden_size=layout.hidden_size, routed_staging=staging,
            shared_staging=shared_staging, route_copy=self.route_copy, claims=self.expand_claims,
            fault=self.expand_fault, num_claimed=self.expand_claimed, reply_seqs=self.reply_seqs,
            done_counter=self.expand_done, token_cap=layout.token_cap,
            routed_cap=layout.routed_cap, rows_bucket=rows))
        reply = kernels.PackedLaunch(specs.graph_dedup_reply_spec(
            dtype_code=res.dtype_code, own_window=res.own_window, peer_windows=self.peer_windows,
            geo=res.geometry, src_rank=res.src_rank, state=self.state,
            route_copy=self.route_copy, top_k=layout.top_k, routed_outs=routed_outs, shared_out=0,
            hidden_size=layout.hidden_size, done_counter=self.reply_done,
            token_cap=layout.token_cap, rows_bucket=rows, num_chunks=self.num_chunks))
        return expand, reply

    def _expert_ops(self, x: torch.Tensor, xs: torch.Tensor | None):
        """The expert math over the staging rows, capturable: per layer chunk two grouped GEMMs
        (offsets from the device), the activation and the routed scaling; the shared experts
        the same over one group per layer. Rows past the served item's are never read."""
        epr, lpc = self.layout.expert_per_rank, self.lpc
        offs_all = self.routed_offs_t
        stream = self.expert_gemm == "stream"
        outs = []
        for chunk in range(self.num_chunks):
            groups = slice(chunk * lpc * epr, min(self.num_layers, (chunk + 1) * lpc) * epr)
            if stream:
                out = _streamed_mlp(x, offs_all[groups], self.weights.routed(groups), experts_per_layer=epr)
            else:
                out = _gated_mlp(x, self.weights.w13[groups], self.weights.w2[groups], offs_all[groups],
                                 self.weights.activation)
            factor = self.model.routed_scaling_factor
            outs.append(out if factor == 1.0 else out * factor)  # bf16: routed x f (moe rule)
        shared_out = None
        if xs is not None:
            shared_out = (_streamed_mlp(xs, self.shared_offs_t, self.weights.shared(), experts_per_layer=1)
                          if stream else
                          _gated_mlp(xs, self.weights.shared_w13, self.weights.shared_w2, self.shared_offs_t,
                                     self.weights.shared_activation))
        return outs, shared_out



def _gated_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
               weights: moe.ExpertWeights) -> torch.Tensor:
    """Two grouped GEMMs and the gated activation (``weights``' options), as
    ``moe._grouped_mlp_fused`` without biases. NOTE: output rows past ``offs[-1]`` are left
    unwritten by torch._grouped_mm (no GEMM work for them); nobody reads them."""
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    hidden = moe.act_and_mul(gate_up, x.dtype, weights)
    return torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offs)


def _streamed_mlp(x: torch.Tensor, offs: torch.Tensor, weights, *, experts_per_layer: int) -> torch.Tensor:
    """:func:`_gated_mlp` through ``moe.stream_gemm`` (``expert_gemm="stream"``; ``weights`` the
    stacked groups, bf16 or FP8): one program per (output tile, expert of a layer), walking
    that expert in each stacked layer; rows past ``offs[-1]`` are left unwritten as well."""
    return stream_gemm.stacked_mlp_streamed(x, offs, weights, experts_per_layer=experts_per_layer)
