"""Roles, role ranks, world ranks and expert ownership (docs/design/topology.md).

World rank = NVSHMEM PE. Attention ranks come first: attention role rank i is world rank i,
FFN role rank j is world rank ``num_attn_ranks + j``. FFN rank r owns the global experts
``[r * expert_per_rank, (r + 1) * expert_per_rank)``; the tail past ``num_experts`` is
padding that never receives tokens.
"""
from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass

from afd_cupy.errors import TopologyError


class Role(str, enum.Enum):
    ATTENTION = "attention"
    FFN = "ffn"

    @property
    def opposite(self) -> "Role":
        return Role.FFN if self is Role.ATTENTION else Role.ATTENTION


@dataclass(frozen=True)
class Topology:
    """A Attention ranks, F FFN ranks and E routed experts."""

    num_attn_ranks: int
    num_ffn_ranks: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("num_attn_ranks", "num_ffn_ranks", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"Topology.{name} must be an int >= 1, got {value!r}")
        last_first = (self.num_ffn_ranks - 1) * self.expert_per_rank
        if last_first >= self.num_experts:
            raise TopologyError(
                f"{self.num_ffn_ranks} FFN ranks for {self.num_experts} experts "
                f"({self.expert_per_rank} per rank): FFN rank {self.num_ffn_ranks - 1} "
                "would own no real expert")

    @classmethod
    def from_configs(cls, model, topology) -> "Topology":
        return cls(topology.num_attn_ranks, topology.num_ffn_ranks, model.num_experts)

    @property
    def world_size(self) -> int:
        return self.num_attn_ranks + self.num_ffn_ranks

    @property
    def num_regions(self) -> int:
        """Regions per window on both roles, so every symmetric allocation has one size."""
        return max(self.num_attn_ranks, self.num_ffn_ranks)

    @property
    def expert_per_rank(self) -> int:
        return -(-self.num_experts // self.num_ffn_ranks)

    def num_role_ranks(self, role: Role) -> int:
        return self.num_attn_ranks if Role(role) is Role.ATTENTION else self.num_ffn_ranks

    def world_rank(self, role: Role, role_rank: int) -> int:
        """World rank (NVSHMEM PE) of ``role_rank`` of ``role``."""
        role = Role(role)
        size = self.num_role_ranks(role)
        if isinstance(role_rank, bool) or not isinstance(role_rank, numbers.Integral):
            raise TopologyError(f"{role.value} role rank must be an int, got "
                                f"{type(role_rank).__name__} {role_rank!r}")
        if not 0 <= role_rank < size:
            raise TopologyError(f"{role.value} role rank {role_rank} out of range [0, {size})")
        return role_rank if role is Role.ATTENTION else self.num_attn_ranks + role_rank

    def role_of(self, world_rank: int) -> tuple[Role, int]:
        """(role, role rank) of a world rank."""
        if not 0 <= world_rank < self.world_size:
            raise TopologyError(f"world rank {world_rank} out of range [0, {self.world_size})")
        if world_rank < self.num_attn_ranks:
            return Role.ATTENTION, world_rank
        return Role.FFN, world_rank - self.num_attn_ranks

    def expert_owner(self, expert_idx: int) -> int:
        """FFN role rank that owns global expert ``expert_idx``."""
        if not 0 <= expert_idx < self.num_experts:
            raise TopologyError(f"expert {expert_idx} out of range [0, {self.num_experts})")
        return expert_idx // self.expert_per_rank

    def owned_experts(self, ffn_rank: int) -> range:
        """Real (non-padding) global experts of ``ffn_rank``; may be shorter than expert_per_rank."""
        if not 0 <= ffn_rank < self.num_ffn_ranks:
            raise TopologyError(f"FFN rank {ffn_rank} out of range [0, {self.num_ffn_ranks})")
        first = ffn_rank * self.expert_per_rank
        return range(min(first, self.num_experts), min(first + self.expert_per_rank, self.num_experts))
