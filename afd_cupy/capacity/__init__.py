"""Capacity planner for AFD serving: a discrete-event simulator of async and lockstep
schedules (no GPU needed), a cost model calibrated from the benchmarks' JSON, and a search
for the best Attention:FFN split. docs/design/planner.md describes the model.

    from afd_cupy.capacity import ModelShape, Deployment, ReplicaLoad, SimConfig, simulate
"""
from __future__ import annotations

from afd_cupy.capacity.costs import Costs, h200_costs  # noqa: F401
from afd_cupy.capacity.results import FFNResult, ReplicaResult, SimResult  # noqa: F401
from afd_cupy.capacity.sim import Simulator, simulate  # noqa: F401
from afd_cupy.capacity.spec import (  # noqa: F401
    LINK_PRESETS, Deployment, Link, ModelShape, Placement, ReplicaLoad, SimConfig, parse_placements,
)
