"""Host backend data path: numpy over POSIX shared memory, numba planner and combine.

Same wire format and protocol as the cuda backend; every step runs on the calling thread,
so errors are raised where they happen.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import planner, wire
from afd_cupy.errors import ConnectorShutdown, ProtocolError, reply_timeout_error
from afd_cupy.payload import raw_dtype, raw_to_f32, raw_to_torch, torch_to_raw


@dataclass
class HostSendState:
    """What the combine of one dispatch needs (stays on the Attention side)."""

    plan: planner.DispatchPlan
    expected: np.ndarray  # int64 [F]: seq sent to FFN rank j, 0 when nothing was sent
    shared_counts: np.ndarray  # int64 [F]


class HostDataPath:
    """Dispatch/combine (Attention) and receive/reply (FFN) on numpy windows."""

    def __init__(self, conn):
        self.conn = conn
        self.window = conn.window
        self.layout = conn.layout
        self.dtype_name = conn.model.dtype
        self.raw = raw_dtype(self.dtype_name)

    # --- Attention side -----------------------------------------------------------------
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, *, layer_idx: int,
                 stage_idx: int, ring: int) -> HostSendState:
        conn, layout = self.conn, self.layout
        num_ffn = conn.topology.num_ffn_ranks
        num_tokens = hidden.shape[0]
        ids = topk_ids.to(torch.int32).numpy()
        plan = planner.plan_dispatch(ids, num_ffn, layout.expert_per_rank, conn.model.num_experts)
        shared = np.array([planner.shared_count(num_tokens, num_ffn, j) if conn.has_shared else 0
                           for j in range(num_ffn)], np.int64)
        for j in range(num_ffn):  # every check before any write: nothing is half-sent
            wire.check_capacity(layout, num_tokens=num_tokens, routed_tokens=plan.routed_count(j),
                                shared_tokens=int(shared[j]), peer=j)
        raw = torch_to_raw(hidden, self.dtype_name).reshape(num_tokens, layout.hidden_size)
        expected = np.zeros(num_ffn, np.int64)
        for j in range(num_ffn):
            if plan.routed_count(j) == 0 and shared[j] == 0 and not conn.always_send:
                continue  # empty message: not sent, not waited on
            expected[j] = conn.next_seq(j, ring)
            self._send_to(j, plan, raw, int(shared[j]), ring, expected[j], layer_idx, stage_idx, num_tokens)
        return HostSendState(plan, expected, shared)

    def _send_to(self, ffn_rank, plan, raw, num_shared, ring, seq, layer_idx, stage_idx, num_tokens):
        conn = self.conn
        route_table = plan.rank_route_table(ffn_rank)
        fields = {"route_table": route_table, "routed_x": raw[route_table[:, 0]]}
        if num_shared:
            shared_idx = planner.shared_split(num_tokens, conn.topology.num_ffn_ranks, ffn_rank)
            fields["shared_idx"] = shared_idx
            fields["shared_x"] = raw[shared_idx]
        header = wire.Header(
            seq=int(seq), src_rank=conn.role_rank, layer_idx=layer_idx, stage_idx=stage_idx,
            num_tokens=num_tokens, routed_tokens=len(route_table), shared_tokens=num_shared,
            top_k=plan.top_k, flags=0, echo_seq=0, expert_counts=tuple(plan.rank_counts(ffn_rank)))
        self.window.write_message(conn.ffn_pe(ffn_rank), conn.role_rank, ring,
                                  wire.encode_header(header, self.layout.expert_per_rank), int(seq), fields)

    def combine(self, state: HostSendState, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                *, ring: int, layer_idx: int, out_scale: float) -> torch.Tensor:
        conn = self.conn
        num_ffn = conn.topology.num_ffn_ranks
        hidden = self.layout.hidden_size
        routed_rows, shared_rows = [], []
        for j in range(num_ffn):
            if state.expected[j] == 0:
                routed_rows.append(np.zeros((0, hidden), np.float32))
                shared_rows.append(np.zeros((0, hidden), np.float32))
                continue
            header = self._wait_reply(j, ring, int(state.expected[j]), layer_idx)
            self._check_reply(header, j, state)
            routed_rows.append(self._rows(j, ring, "routed_x", header.routed_tokens))
            shared_rows.append(self._rows(j, ring, "shared_x", header.shared_tokens))
        num_tokens = state.plan.num_tokens
        out = np.full((num_tokens, hidden), np.nan, np.float32)
        if num_tokens:
            planner.combine(out, topk_ids.to(torch.int32).numpy(), topk_weights.to(torch.float32).numpy(),
                            state.plan.pos, self.layout.expert_per_rank, routed_rows,
                            shared_rows if conn.has_shared else None, out_scale)
        return torch.from_numpy(out).to(conn.torch_dtype)

    def _wait_reply(self, ffn_rank: int, ring: int, expected_seq: int, layer_idx: int) -> wire.Header:
        window = self.window
        deadline = time.monotonic() + self.conn.peer_timeout_s
        flag_view = window.flag_view(self.conn.world_rank, ffn_rank, ring)
        seen = window.seen(ffn_rank, ring)
        while int(flag_view[0]) == seen:
            if time.monotonic() >= deadline:
                raise reply_timeout_error(ffn_rank, ring, layer_idx, expected_seq, seen,
                                          self.conn.peer_timeout_s)
            time.sleep(0)
        flag = int(flag_view[0])
        window.mark_seen(ffn_rank, ring, flag)
        words = np.array(window.header_view(self.conn.world_rank, ffn_rank, ring))
        return wire.decode_header(words, self.layout.expert_per_rank)

    def _check_reply(self, header: wire.Header, ffn_rank: int, state: HostSendState) -> None:
        if header.is_shutdown:
            raise ConnectorShutdown(f"FFN rank {ffn_rank} announced shutdown while a reply was pending",
                                    src_rank=ffn_rank)
        expected = int(state.expected[ffn_rank]) & 0xFFFFFFFF
        if header.echo_seq != expected:
            raise ProtocolError(f"reply from FFN rank {ffn_rank} echoes seq {header.echo_seq}, "
                                f"pending dispatch has seq {expected}")
        sent = state.plan.routed_count(ffn_rank)
        if header.routed_tokens != sent or header.shared_tokens != state.shared_counts[ffn_rank]:
            raise ProtocolError(
                f"reply from FFN rank {ffn_rank} has {header.routed_tokens} routed / "
                f"{header.shared_tokens} shared rows, sent {sent} / {int(state.shared_counts[ffn_rank])}")

    def _rows(self, region: int, ring: int, name: str, count: int) -> np.ndarray:
        view = self.window.field(self.conn.world_rank, region, ring, name, self.raw,
                                 (count, self.layout.hidden_size))
        return raw_to_f32(np.asarray(view), self.dtype_name)

    # --- FFN side -----------------------------------------------------------------------
    def wait_any(self, timeout_s: float):
        """(region, ring, header words int32 copy) of the next arrival, or None."""
        arrival = self.window.wait_any(timeout_s)
        if arrival is None:
            return None
        words = np.array(self.window.header_view(self.conn.world_rank, arrival.region, arrival.ring))
        return arrival.region, arrival.ring, words

    def item_views(self, region: int, ring: int, header: wire.Header):
        """Zero-copy torch views (routed_x, shared_x, route_table) of a received slot."""
        pe, hidden, name = self.conn.world_rank, self.layout.hidden_size, self.dtype_name
        routed = raw_to_torch(self.window.field(pe, region, ring, "routed_x", self.raw,
                                                (header.routed_tokens, hidden)), name)
        shared = raw_to_torch(self.window.field(pe, region, ring, "shared_x", self.raw,
                                                (header.shared_tokens, hidden)), name)
        route = torch.from_numpy(self.window.field(pe, region, ring, "route_table", np.int32,
                                                   (header.routed_tokens, 2)))
        group_list = torch.tensor(header.expert_counts, dtype=torch.int32)
        return routed, shared, route, group_list

    def reply(self, attn_rank: int, ring: int, header_words, seq: int,
              routed_out: torch.Tensor, shared_out: torch.Tensor | None) -> None:
        """Write the outputs, the header (int32 words, any sequence), then the flag."""
        fields = {"routed_x": torch_to_raw(routed_out, self.dtype_name)}
        if shared_out is not None:
            fields["shared_x"] = torch_to_raw(shared_out, self.dtype_name)
        self.window.write_message(self.conn.attn_pe(attn_rank), self.conn.role_rank, ring,
                                  header_words, seq, fields)

    def send_control(self, pe: int, ring: int, header_words: np.ndarray, seq: int) -> None:
        self.window.write_message(pe, self.conn.role_rank, ring, header_words, seq)

    def close(self) -> None:
        pass
