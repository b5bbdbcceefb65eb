"""The decode step's plan, before any GPU work: the micro-batch split, the issue order and
the checks that a step can be captured (afd_cupy.attention.step_graph, issue #13 and #15 item 3).

:func:`split_rows` cuts T rows into S contiguous micro-batches (sizes as even as possible,
the larger first); :func:`pipeline_schedule` is the order :class:`~afd_cupy.attention.step_graph.
DecodeStepGraph` issues the layers' sends and receives in (its module doc says why the order
is legal); :func:`check_capturable` / :func:`check_stages` raise ConfigError with the values
when a connector cannot run a captured step. Pure host code: no torch, no GPU.
"""
from __future__ import annotations

import numbers

from afd_cupy.errors import ConfigError
from afd_cupy.runtime.topology import Role

#: the two operations of the step's schedule (:func:`pipeline_schedule`)
SEND, RECV = "send", "recv"


def _check_stages(stages) -> int:
    if isinstance(stages, bool) or not isinstance(stages, numbers.Integral) or stages < 1:
        raise ConfigError(f"stages must be an int >= 1, got {stages!r}")
    return int(stages)


def split_rows(num_tokens: int, stages: int) -> tuple[tuple[int, int], ...]:
    """The ``stages`` contiguous micro-batches of ``num_tokens`` rows: ``(start, stop)`` per
    stage, sizes as even as possible (the first ``num_tokens % stages`` one row larger), each
    at least one row. ConfigError (with the values) when ``num_tokens < stages``."""
    stages = _check_stages(stages)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < stages:
        raise ConfigError(f"num_tokens={num_tokens!r} rows cannot be split into stages={stages} "
                          "micro-batches of at least one row each (need num_tokens >= stages)")
    base, extra = divmod(int(num_tokens), stages)
    bounds, start = [], 0
    for stage in range(stages):
        stop = start + base + (1 if stage < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def pipeline_schedule(num_layers: int, stages: int) -> tuple[tuple[str, int, int], ...]:
    """The step's issue order on its one stream: ``(op, layer, stage)`` with op ``SEND``
    (attention + gate + send of micro-batch ``stage`` at ``layer``) or ``RECV`` (its receive +
    residual add). Layer 0 is sent for every stage, then for each layer and stage in order:
    receive, and send the stage's next layer. Each stage alternates send, recv (at most one
    dispatch per stage pending); ``stages=1`` is send, recv per layer (module doc)."""
    stages = _check_stages(stages)
    order = [(SEND, 0, stage) for stage in range(stages)]
    for layer in range(num_layers):
        for stage in range(stages):
            order.append((RECV, layer, stage))
            if layer + 1 < num_layers:
                order.append((SEND, layer + 1, stage))
    return tuple(order)


def check_capturable(connector, num_tokens: int, num_layers: int, stages: int = 1) -> None:
    """Raise ConfigError (with the values) when a step of ``num_layers`` layers of
    ``num_tokens`` tokens in ``stages`` micro-batches cannot be captured on ``connector``.

    Needs: an Attention-side connector whose receive does not block
    (``connector.capabilities.supports_nonblocking``: the cuda backend; the host backend's
    steps run on the CPU and block) waiting on the device (``capabilities.device_polling``:
    ``poll_mode="device"``) (host polling synchronizes per receive);
    1 <= num_tokens <= the window's ``token_cap``; 1 <= num_layers <= ``model.num_layers``
    (layer l of the step is the model's layer l); 1 <= stages <= the connector's
    ``ConnectorConfig.num_stages`` (micro-batch s is sent as stage s, on that stage's rings:
    S stages in flight need S ring sets) and stages <= num_tokens (every micro-batch has a
    row). The ring depth is no limit: each stage has one dispatch in flight at a time (its
    receive precedes its next send), so micro-batch s always reuses ring s and any
    ``ring_depth`` (>= num_stages, as the config requires) suffices.
    """
    if connector.role is not Role.ATTENTION:
        raise ConfigError(f"a decode step is captured on an Attention-side connector, got role "
                          f"{connector.role.value!r}")
    capabilities = connector.capabilities  # the data path's declared capabilities
    if not capabilities.supports_nonblocking:
        raise ConfigError(f"backend={capabilities.backend!r}: its receive blocks on the host "
                          "(supports_nonblocking=False), so a step cannot be captured in a CUDA graph; "
                          "capture on a backend whose recv_ffn_output(blocking=False) enqueues (cuda)")
    if not capabilities.device_polling:
        raise ConfigError("poll_mode='host': a captured receive must wait on the device "
                          "(poll_mode='device'); host polling synchronizes per receive")
    cap = connector.layout.token_cap
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) \
            or not 1 <= num_tokens <= cap:
        raise ConfigError(f"num_tokens={num_tokens!r} must be an int in [1, token_cap={cap}] "
                          "(token_cap = ModelConfig.max_num_batched_tokens)")
    total = connector.model.num_layers
    if not 1 <= num_layers <= total:
        raise ConfigError(f"{num_layers} layers in the step: must be in [1, model.num_layers={total}]")
    check_stages(connector, stages)
    split_rows(num_tokens, stages)


def check_stages(connector, stages: int) -> int:
    """``stages`` if the connector has that many micro-batch stages, else ConfigError."""
    stages = _check_stages(stages)
    config = connector.config
    if stages > config.num_stages:
        raise ConfigError(f"stages={stages} needs a connector with at least {stages} micro-batch stages "
                          f"(ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches={stages}) on "
                          f"every rank); this one has num_stages={config.num_stages} "
                          f"(async_moe_ubatching={config.async_moe_ubatching}, "
                          f"async_moe_num_ubatches={config.async_moe_num_ubatches})")
    return stages
