"""Fault injection: slow, dead, duplicate and misconfigured peers, bad input (docs/design/fault-model.md,
"Fault model"). Every case bounds its own run time and asserts the error type and what it
names; the same cases run on the host backend (CI) and the cuda backend (GPU suite)."""
from __future__ import annotations

import functools
import glob
import logging
import math
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from afd_cupy import wire
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.errors import (BackendUnavailableError, ConfigError, InvalidRoutingError,
                             PeerLostError, PeerTimeoutError, ProtocolError, WireError)
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.runtime.launch import DiedAsExpected, LaunchError, launch
from afd_cupy.runtime.store import store_fetch, store_publish
from afd_cupy.runtime.topology import Role
from afd_cupy.testing.reference import identity_experts

from helpers.backends import BACKENDS, PATHS
from helpers.programs import (FAULT_MODEL, FAULT_TIMEOUT_S, POLL_MODE, bad_input_program, connect,
                              next_item, round_trip_error, seeded_inputs)


def _job_segments(job_id):
    return glob.glob(f"/dev/shm/afd_{job_id}_*")


# --- one ring used from two streams (cuda): each use waits for the previous one ----------------
def _two_streams_program(ctx):
    conn, role, _ = connect(ctx, "cuda", timeout_s=10.0)
    try:
        if role is Role.FFN:
            return {"served": FFNWorker(conn, expert_fn=identity_experts).run()}
        a, b = torch.cuda.Stream(), torch.cuda.Stream()

        def error(out, hidden, weights):
            expect = hidden.float() * (weights.float().sum(dim=1, keepdim=True) + 1.0)
            return float((out.float() - expect).abs().max())

        inputs = [seeded_inputs(conn, n, seed=s) for n, s in ((6, 1), (6, 2), (9, 3))]
        torch.cuda.synchronize()
        # 1. a send queued behind a ~0.1 s kernel on stream A, its receive on stream B: the wait
        #    and the combine on B must not run before A's scatter set what they read
        x, ids, w = inputs[0]
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)
            handle = conn.send_attn_output(x, ids, w, 0)
        with torch.cuda.stream(b):
            first = error(conn.recv_ffn_output(handle), x, w)
        # 2. a non-blocking receive queued behind a long kernel on A, then a send and receive of
        #    the same ring on B: B's scatter must not overwrite what A's combine still reads
        x1, ids1, w1 = inputs[1]
        x2, ids2, w2 = inputs[2]
        with torch.cuda.stream(a):
            handle = conn.send_attn_output(x1, ids1, w1, 1)
            torch.cuda._sleep(200_000_000)
            out1 = conn.recv_ffn_output(handle, blocking=False)
        with torch.cuda.stream(b):
            out2 = conn.recv_ffn_output(conn.send_attn_output(x2, ids2, w2, 2))
        a.synchronize()
        conn.check_errors()
        result = {"errors": [first, error(out1, x1, w1), error(out2, x2, w2)]}
        conn.announce_shutdown()
        return result
    finally:
        conn.close()


@pytest.mark.cuda
def test_one_ring_used_from_two_streams_is_ordered():
    attn, ffn = launch(_two_streams_program, 2, timeout_s=120)
    assert max(attn["errors"]) < 0.1, attn  # bf16 identity round trip; wrong rows are off by O(1)
    assert ffn["served"] == 3


# --- an FFN wait interrupted after its kernel was queued: the arrival is not lost (cuda) -------
def _interrupted_wait_program(ctx, recv_spin_us):
    conn, role, _ = connect(ctx, "cuda", timeout_s=10.0, recv_spin_us=recv_spin_us)
    store = ctx.store()
    try:
        if role is Role.FFN:
            def interrupt(signum, frame):
                raise KeyboardInterrupt

            previous = signal.signal(signal.SIGALRM, interrupt)
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            start = time.monotonic()
            try:
                conn.recv_ffn_work_item(5000)  # spinning: one wait_any kernel, alive for 5 s
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            handled_after_s = time.monotonic() - start
            store.set("interrupted", b"1")
            time.sleep(0.5)  # the dispatch lands (spinning: while only the interrupted kernel watches)
            return {"interrupted": interrupted, "handled_after_s": handled_after_s,
                    "served": FFNWorker(conn, expert_fn=identity_experts).run()}
        store.get("interrupted")
        error = round_trip_error(conn, 0, seed=4)
        conn.announce_shutdown()
        return {"error": error}
    finally:
        conn.close()


@pytest.mark.cuda
@pytest.mark.skipif(POLL_MODE != "device", reason="the doorbell exists with device polling only")
@pytest.mark.parametrize("recv_spin_us", [10_000_000, 500], ids=["spinning", "sleeping"])
def test_arrival_consumed_by_an_interrupted_wait_is_returned_by_the_next(recv_spin_us):
    # spinning (spin > the 5 s wait): the alarm interrupts the host loop while the kernel keeps
    # watching, and the arrival it consumes must come back from the next receive; sleeping
    # (the default): the host sleeps in the driver, and the alarm is handled once the current
    # wait kernel (at most cuda_ffn._BLOCKING_CHUNK_S = 0.1 s) ends, not after 5 s
    attn, ffn = launch(_interrupted_wait_program, 2, args=(recv_spin_us,), timeout_s=120)
    assert ffn["interrupted"] and ffn["served"] == 1, ffn
    assert 0.3 <= ffn["handled_after_s"] < 1.0, ffn
    assert attn["error"] < 0.1, attn


# --- a peer that nvshmem_ptr cannot map: every PE raises, NVSHMEM is finalized, restart works -
class _UnreachablePeer:
    """The NVSHMEM binding with ``nvshmem_ptr`` returning NULL for PE 0 (as on another node)."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def nvshmem_ptr(self, base_ptr, pe):
        return 0 if pe == 0 else self._lib.nvshmem_ptr(base_ptr, pe)


def _unreachable_program(ctx):
    from afd_cupy.errors import HeapError
    from afd_cupy.heap import nvshmem as heap_module

    real_load = heap_module.load_library
    if ctx.rank == 1:
        heap_module.load_library = lambda *a, **kw: _UnreachablePeer(real_load(*a, **kw))
    try:
        start = time.monotonic()
        try:
            connect(ctx, "cuda", timeout_s=10.0)[0].close()
            first = None
        except HeapError as err:
            first = str(err)
        first_s = time.monotonic() - start
    finally:
        heap_module.load_library = real_load
    # a window larger than the device's free memory: refused on every PE before nvshmem_malloc
    from afd_cupy.errors import NvshmemError
    huge = ModelConfig(hidden_size=8192, num_experts=4, top_k=2, moe_intermediate_size=16,
                       num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=6_000_000,
                       num_layers=8)
    try:
        connect(ctx, "cuda", model=huge, timeout_s=10.0)[0].close()
        too_big = None
    except NvshmemError as err:
        too_big = str(err)
    conn, role, _ = connect(ctx, "cuda", timeout_s=10.0)  # NVSHMEM starts again: it was finalized
    try:
        if role is Role.FFN:
            return {"first": first, "too_big": too_big,
                    "served": FFNWorker(conn, expert_fn=identity_experts).run()}
        error = round_trip_error(conn, 0, seed=5)
        conn.announce_shutdown()
        return {"first": first, "too_big": too_big, "first_s": first_s, "error": error}
    finally:
        conn.close()


@pytest.mark.cuda
def test_unreachable_peer_or_oversized_heap_raises_on_every_pe_and_nvshmem_restarts():
    attn, ffn = launch(_unreachable_program, 2, timeout_s=120)
    for report in (attn, ffn):
        assert report["first"] is not None and "PE 0 on PE 1" in report["first"], report
        assert report["too_big"] is not None and "does not fit" in report["too_big"], report
        assert "PE 0" in report["too_big"] and "PE 1" in report["too_big"], report
    assert attn["first_s"] < 30.0 and attn["error"] < 0.1 and ffn["served"] == 1, attn


# --- tensors on another GPU than the connector's are rejected, on both sides (2 GPUs) ----------
def _other_gpu_program(ctx):
    conn, role, _ = connect(ctx, "cuda", timeout_s=10.0)
    other = torch.device("cuda", 1 - conn.device.index)
    try:
        if role is Role.FFN:
            item = next_item(conn)
            routed, shared = identity_experts(item)
            rejected = []
            for name, args in (("routed_out", (routed.to(other), shared)),
                               ("shared_out", (routed, shared.to(other)))):
                try:
                    conn.send_ffn_work_item_output(item, *args)
                except ValueError as err:
                    rejected.append((name, str(err)))
            conn.send_ffn_work_item_output(item, routed, shared)
            return {"rejected": rejected, "served": FFNWorker(conn, expert_fn=identity_experts).run() + 1}
        hidden, ids, weights = seeded_inputs(conn, 6, seed=6)
        rejected = []
        for name, args in (("hidden", (hidden.to(other), ids, weights)),
                           ("topk_ids", (hidden, ids.to(other), weights)),
                           ("topk_weights", (hidden, ids, weights.to(other)))):
            try:
                conn.send_attn_output(*args, 0)
            except ValueError as err:
                rejected.append((name, str(err)))
        out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
        expect = hidden.float() * (weights.float().sum(dim=1, keepdim=True) + 1.0)
        conn.announce_shutdown()
        return {"rejected": rejected, "error": float((out.float() - expect).abs().max()),
                "device": conn.device.index}
    finally:
        conn.close()


@pytest.mark.cuda
@pytest.mark.multigpu
def test_tensors_on_another_gpu_are_rejected_on_both_sides():
    attn, ffn = launch(_other_gpu_program, 2, timeout_s=120)
    assert [name for name, _ in attn["rejected"]] == ["hidden", "topk_ids", "topk_weights"], attn
    assert [name for name, _ in ffn["rejected"]] == ["routed_out", "shared_out"], ffn
    for name, text in attn["rejected"] + ffn["rejected"]:
        assert f"{name} is on cuda:" in text and "this connector's tensors live on cuda:" in text, text
    assert attn["error"] < 0.1 and ffn["served"] == 1, (attn, ffn)


# --- a slow FFN: the late layer raises, the next layers on the same connector are right -------
def _slow_program(ctx, backend, wire_mode):
    conn, role, _ = connect(ctx, backend, connector=ConnectorConfig(wire_mode=wire_mode))
    try:
        if role is Role.FFN:
            slept = []

            def slow_once(item):
                if not slept:
                    slept.append(item.layer_idx)
                    time.sleep(1.6 * FAULT_TIMEOUT_S)  # longer than the timeout, shorter than two
                return identity_experts(item)

            return {"served": FFNWorker(conn, expert_fn=slow_once).run()}
        out = {}
        hidden, ids, weights = seeded_inputs(conn, 6, seed=0)
        try:
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
        except PeerTimeoutError as err:
            out["timeout"] = (err.peer, err.layer_idx)
        out["errors"] = [round_trip_error(conn, layer, seed=layer) for layer in range(1, 6)]
        conn.announce_shutdown()
        return out
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_slow_ffn_times_out_once_then_later_layers_are_correct(backend, wire_mode):
    attn, ffn = launch(_slow_program, 2, args=(backend, wire_mode), timeout_s=90)
    assert attn["timeout"] == (0, 0)
    assert max(attn["errors"]) < 0.1, attn  # bf16 identity round trip: right rows, right sum
    assert ffn["served"] == 6  # the late reply was written, then dropped by the Attention side


# --- a forgotten dispatch: its ring is sent on again, its late reply is dropped by seq ---------
def _forgotten_program(ctx, backend, wire_mode):
    conn, role, _ = connect(ctx, backend, timeout_s=10.0, connector=ConnectorConfig(wire_mode=wire_mode))
    store = ctx.store()
    try:
        if role is Role.FFN:
            worker = FFNWorker(conn, expert_fn=identity_experts)
            first = next_item(conn)
            store.set("got_first", b"1")  # else the second dispatch may overwrite it unseen
            store.get("resent")  # the Attention rank forgot the first dispatch and sent again
            time.sleep(0.2)
            worker.serve(first)  # the late reply: seq of the forgotten dispatch
            return {"first_layer": first.layer_idx, "served": worker.run()}  # run() counts serve()
        hidden, ids, weights = seeded_inputs(conn, 6, seed=1)
        forgotten = conn.send_attn_output(hidden, ids, weights, 0)
        conn.forget_dispatch(forgotten)
        with pytest.raises(ProtocolError, match="not pending"):
            conn.recv_ffn_output(forgotten)
        hidden, ids, weights = seeded_inputs(conn, 6, seed=2)
        store.get("got_first")
        handle = conn.send_attn_output(hidden, ids, weights, 1)
        store.set("resent", b"1")
        out = conn.recv_ffn_output(handle)
        expect = hidden.float() * (weights.float().sum(dim=1, keepdim=True) + 1.0)
        error = float((out.float() - expect).abs().max())
        later = [round_trip_error(conn, layer, seed=layer) for layer in range(2, 4)]
        conn.announce_shutdown()
        return {"ring": (forgotten.ring, handle.ring), "error": error, "later": later}
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_forgotten_dispatch_frees_its_ring_and_its_late_reply_is_dropped(backend, wire_mode):
    attn, ffn = launch(_forgotten_program, 2, args=(backend, wire_mode), timeout_s=90)
    assert attn["ring"] == (0, 0), attn  # the same ring, sent on again without a receive
    # the reply of the second dispatch, not the late one of the first (other seed, other layer)
    assert attn["error"] < 0.1 and max(attn["later"]) < 0.1, attn
    assert ffn["first_layer"] == 0 and ffn["served"] == 4, ffn


# --- an FFN that answers the same item twice -------------------------------------------------
def _duplicate_program(ctx, backend, wire_mode):
    conn, role, _ = connect(ctx, backend, timeout_s=10.0, connector=ConnectorConfig(wire_mode=wire_mode))
    try:
        if role is Role.FFN:
            item = next_item(conn)
            routed, shared = identity_experts(item)
            conn.send_ffn_work_item_output(item, routed, shared)
            try:
                conn.send_ffn_work_item_output(item, routed, shared)
                second = None
            except ProtocolError as err:
                second = str(err)
            FFNWorker(conn, expert_fn=identity_experts).run()
            return {"second": second}
        errors = [round_trip_error(conn, layer, seed=layer) for layer in range(3)]
        conn.announce_shutdown()
        return {"errors": errors}
    finally:
        conn.close()


@pytest.mark.parametrize("backend,wire_mode", PATHS)
def test_second_answer_to_one_item_raises_and_results_stay_right(backend, wire_mode):
    attn, ffn = launch(_duplicate_program, 2, args=(backend, wire_mode), timeout_s=90)
    assert ffn["second"] is not None and "already answered" in ffn["second"]
    assert max(attn["errors"]) < 0.1, attn


# --- bad input on the Attention side (one launch per backend, two tests read it) ------------
@functools.lru_cache(maxsize=None)
def _bad_input_results(backend) -> tuple[dict, dict]:
    attn, ffn = launch(bad_input_program, 2, args=(backend,), timeout_s=120)
    return attn, ffn


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_value_errors_naming_the_tensor(backend):
    attn, ffn = _bad_input_results(backend)
    assert attn["shape"] == ("ValueError", "hidden must be a [num_tokens, 32] tensor, got torch.Size([4, 5])")
    assert attn["dtype"][0] == "ValueError" and "hidden has dtype torch.float32" in attn["dtype"][1]
    assert attn["ids"] == ("ValueError", "topk_ids must have shape (4, 2), got (3, 2)")
    assert attn["weights_dtype"][0] == "ValueError" and "topk_weights has wrong dtype" in attn["weights_dtype"][1]
    assert attn["stage"] == ("ValueError", "stage_idx=1 outside [0, 1)")
    assert attn["tokens"][0] == "CapacityError" and "num_tokens=17 > token_cap=16" in attn["tokens"][1]
    assert attn["wrong_role"][0] == "ProtocolError"
    assert attn["ring"][0] == "RingExhaustedError" and "stage 0: all its rings [0]" in attn["ring"][1]
    assert attn["twice"][0] == "ProtocolError" and "not pending" in attn["twice"][1]
    assert attn["ok"] and ffn["served"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_and_the_connector_keeps_working(backend):
    attn, ffn = _bad_input_results(backend)
    assert attn["layer_high"] == ("ValueError", "layer_idx=8 outside [0, 8)")
    assert attn["layer_float"][0] == "ValueError" and "layer_idx must be an int" in attn["layer_float"][1]
    assert attn["bool_ids"][0] == "ValueError" and "topk_ids has wrong dtype torch.bool" in attn["bool_ids"][1]
    assert attn["logits_width"][0] == "ValueError" and "[num_tokens, 4]" in attn["logits_width"][1]
    name, text = attn["wrapped_ids"]
    assert name == InvalidRoutingError.__name__ and "outside [0, 4)" in text
    # the host reports the id itself; the device gets it as -1 (an int32 cast would wrap it)
    shown = attn["wrapped_first"] if backend == "host" else -1
    assert f"topk id {shown} (partial 0)" in text, text
    assert attn["after"] < 0.1
    assert attn["after_shutdown"][0] == "ProtocolError" and "after announce_shutdown" in attn["after_shutdown"][1]
    assert ffn["served"] == 2


# --- a corrupt dedup route table: WireError on the FFN side, the slot is consumed ------------
def _bad_route_table_program(ctx):
    conn, role, _ = connect(ctx, "host", timeout_s=10.0, connector=ConnectorConfig(wire_mode="dedup"))
    try:
        if role is Role.FFN:
            errors = []
            while not errors:
                try:
                    assert conn.recv_ffn_work_item(100) is None
                except WireError as err:
                    errors.append(str(err))
            ctx.store().set("ffn-saw-the-table", b"1")
            return {"error": errors[0], "served": FFNWorker(conn, expert_fn=identity_experts).run()}
        layout, path = conn.layout, conn.path
        table = np.zeros((2, layout.route_width), np.int32)
        table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + FAULT_MODEL.top_k] = [[0, -1], [0, -1]]  # row 0 twice
        header = wire.dispatch_header(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=2,
                                      shared_tokens=0, top_k=FAULT_MODEL.top_k,
                                      expert_counts=(2,) + (0,) * (layout.expert_per_rank - 1),
                                      wire_mode="dedup", num_rows=2)
        path.seqs.set_last((0, 0), 1)  # the path's next dispatch on this slot takes seq 2
        path.window.write_message(path.ctx.peer_pe(Role.FFN, 0), 0, 0,
                                  wire.encode_header(header, layout.expert_per_rank), 1,
                                  {"route_table": table})
        ctx.store().get("ffn-saw-the-table")  # before the next dispatch supersedes it
        errors = [round_trip_error(conn, layer, seed=layer) for layer in range(1, 3)]
        conn.announce_shutdown()
        return {"errors": errors}
    finally:
        conn.close()


def test_bad_dedup_route_table_is_a_wire_error_and_the_connector_stays_usable():
    attn, ffn = launch(_bad_route_table_program, 2, timeout_s=60)
    assert "route table staging rows are not a permutation of [0, 2)" in ffn["error"], ffn
    assert ffn["served"] == 2 and max(attn["errors"]) < 0.1, attn


# --- a dedup message rewritten while the FFN reads it: skipped, not a WireError ---------------
class _SignalOnSkip(logging.Handler):
    """Sets a store key when the FFN logs that it did not serve a rewritten message."""

    def __init__(self, store):
        super().__init__(logging.WARNING)
        self.store, self.loggers = store, []  # the modules that logged it

    def emit(self, record):
        if "not served" in record.getMessage():
            self.loggers.append(record.module)
            self.store.set("ffn-skipped", b"1")


def _torn_route_table_program(ctx, backend, serving):
    conn, role, _ = connect(ctx, backend, timeout_s=10.0, connector=ConnectorConfig(wire_mode="dedup"))
    try:
        if role is Role.FFN:
            handler = _SignalOnSkip(ctx.store())
            logging.getLogger("afd_cupy").addHandler(handler)
            served = FFNWorker(conn, expert_fn=identity_experts, serving=serving).run()
            return {"served": served, "loggers": handler.loggers}
        layout, window = conn.layout, conn.path.window
        # what the FFN reads when its sender re-sent on the slot during the read: a header of
        # seq 1000, a route table mixing two messages (row 0 twice), the flag of the next message
        table = np.zeros((2, layout.route_width), np.int32)
        table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + FAULT_MODEL.top_k] = [[0, -1], [0, -1]]
        header = wire.dispatch_header(seq=1000, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=2,
                                      shared_tokens=0, top_k=FAULT_MODEL.top_k,
                                      expert_counts=(2,) + (0,) * (layout.expert_per_rank - 1),
                                      wire_mode="dedup", num_rows=2)
        window.write_message(conn.path.ctx.peer_pe(Role.FFN, 0), 0, 0,
                             wire.encode_header(header, layout.expert_per_rank), 1001, {"route_table": table})
        if backend == "cuda":
            torch.cuda.synchronize()
        ctx.store().get("ffn-skipped")  # the FFN took it and skipped it (the store's timeout bounds this)
        errors = [round_trip_error(conn, layer, seed=layer) for layer in range(3)]
        conn.announce_shutdown()
        return {"errors": errors}
    finally:
        conn.close()


@pytest.mark.parametrize("backend,serving", [
    pytest.param("host", "loop", id="host"),
    pytest.param("cuda", "loop", id="cuda-loop", marks=pytest.mark.cuda),
    pytest.param("cuda", "graph", id="cuda-graph", marks=pytest.mark.cuda),
])
def test_a_dedup_message_rewritten_while_read_is_skipped_and_serving_goes_on(backend, serving):
    """The route table fails and the slot's flag no longer carries the header's seq: the FFN
    logs "not served" (the graph server itself when it serves) and answers what comes next."""
    attn, ffn = launch(_torn_route_table_program, 2, args=(backend, serving), timeout_s=120)
    assert ffn["served"] == 3 and max(attn["errors"]) < 0.1, (attn, ffn)
    assert ffn["loggers"] == ["cuda_ffn_graph" if serving == "graph" else "endpoint"], ffn


# --- configuration mismatches between ranks --------------------------------------------------
def _mismatch_program(ctx, backend, field, value):
    model = FAULT_MODEL
    if ctx.rank == 1:
        model = ModelConfig(**{**{f: getattr(FAULT_MODEL, f) for f in FAULT_MODEL.__dataclass_fields__}, field: value})
    conn, _, _ = connect(ctx, backend, model=model)
    conn.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("routed_scaling_factor", 2.5),
                                         ("hidden_size", 64), ("num_layers", 9)])
def test_config_mismatch_is_named_on_every_rank(backend, field, value):
    with pytest.raises(LaunchError) as info:
        launch(_mismatch_program, 2, args=(backend, field, value), timeout_s=60)
    failures = info.value.failures
    assert sorted(failures) == [0, 1], failures
    for rank, text in failures.items():
        assert f"GeometryMismatchError: configuration mismatch in 'model.{field}'" in text, text
        assert repr(getattr(FAULT_MODEL, field)) in text and repr(value) in text


def _wire_mode_mismatch_program(ctx):
    connector = ConnectorConfig(wire_mode="dedup" if ctx.rank == 1 else "pair")
    conn, _, _ = connect(ctx, "host", connector=connector)
    conn.close()


def test_wire_mode_mismatch_is_named_on_every_rank():
    with pytest.raises(LaunchError) as info:
        launch(_wire_mode_mismatch_program, 2, timeout_s=60)
    for rank, text in info.value.failures.items():
        assert ("GeometryMismatchError: configuration mismatch in 'connector.wire_mode': rank "
                f"{rank} has {['pair', 'dedup'][rank]!r}") in text, text


# --- construction-time checks (no peer needed) -----------------------------------------------
@pytest.mark.parametrize("name,value", [("peer_timeout_s", math.nan), ("peer_timeout_s", -1.0),
                                        ("peer_timeout_s", math.inf), ("startup_timeout_s", math.nan),
                                        ("startup_timeout_s", 0)])
def test_non_finite_or_non_positive_timeouts_are_rejected(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be a finite number of seconds > 0"):
        AFDConnector(FAULT_MODEL, TopologyConfig(1, 1), role="attention", role_rank=0, store=None,
                     **{name: value})


def test_dict_configs_are_rejected_with_a_hint():
    with pytest.raises(ConfigError, match="use ConnectorConfig.from_mapping"):
        AFDConnector(FAULT_MODEL, TopologyConfig(1, 1), {"ring_depth": 2}, role="attention",
                     role_rank=0, store=None)


def test_dedup_over_puts_passes_the_config_checks_host_puts_do_not():
    # docs/design/put-transport.md: the cuda backend runs both wire modes over every transport; the host
    # backend refuses puts in either mode, before any collective step (store=None)
    from afd_cupy.backends.base import require_backend

    with pytest.raises(ConfigError, match=r"backend 'host' does not implement transport='put' "
                                          r"\(it implements \('direct', 'auto'\)\)"):
        AFDConnector(FAULT_MODEL, TopologyConfig(1, 1), ConnectorConfig(wire_mode="dedup", transport="put"),
                     role="attention", role_rank=0, store=None, backend="host")
    try:
        module = require_backend("cuda", "dedup", "put")
    except BackendUnavailableError:  # no CuPy / NVSHMEM here: past every ConfigError
        return
    assert "dedup" in module.CAPABILITIES.wire_modes and "put" in module.CAPABILITIES.transports


def test_cuda_backend_without_cupy_is_backend_unavailable():
    pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="cupy"):
            AFDConnector(FAULT_MODEL, TopologyConfig(1, 1), role="attention", role_rank=0, store=None,
                         backend="cuda")
    else:
        pytest.skip("cupy is importable here")


# --- dead peers: bounded errors, prompt close, nothing left in /dev/shm ----------------------
def _kill_program(ctx, backend, victim, sig):
    conn, role, _ = connect(ctx, backend)
    out = {}
    try:
        if role is Role.FFN:
            served = []

            def serve(item):
                if ctx.rank == victim and len(served) == 2:
                    os.kill(os.getpid(), sig)
                    time.sleep(30)
                served.append(item.layer_idx)
                return identity_experts(item)

            start = time.monotonic()
            try:
                FFNWorker(conn, expert_fn=serve).run()
            except PeerLostError as err:
                out["error"] = ("PeerLostError", err.peers, time.monotonic() - start)
            return out
        for layer in range(FAULT_MODEL.num_layers):
            if ctx.rank == victim and layer == 2:
                os.kill(os.getpid(), sig)
                time.sleep(30)
            start = time.monotonic()
            try:
                round_trip_error(conn, layer, seed=layer)
            except PeerTimeoutError as err:
                out["error"] = ("PeerTimeoutError", err.peer, time.monotonic() - start)
                break
        return out
    finally:
        start = time.monotonic()
        conn.close()
        out["close_s"] = time.monotonic() - start
        out["segments"] = _job_segments(ctx.job_id)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill9", "term"])
@pytest.mark.parametrize("victim", [0, 1], ids=["attention", "ffn"])
def test_dead_peer_is_reported_within_the_timeout_and_close_returns(backend, sig, victim):
    results = launch(_kill_program, 2, args=(backend, victim, sig), timeout_s=90,
                     expected_deaths={victim})
    assert isinstance(results[victim], DiedAsExpected)
    survivor = results[1 - victim]
    kind, peer, elapsed = survivor["error"]
    if victim == 1:
        assert kind == "PeerTimeoutError" and peer == 0 and elapsed <= FAULT_TIMEOUT_S + 1.0, survivor
    else:
        assert kind == "PeerLostError" and tuple(peer) == (0,), survivor
    assert survivor["close_s"] <= FAULT_TIMEOUT_S + 1.0, survivor
    assert survivor["segments"] == [], survivor


# --- consecutive connectors in one job; an Attention rank that fails before shutdown ---------
def _consecutive_program(ctx, backend):
    errors = []
    for instance in range(3):
        conn, role, _ = connect(ctx, backend, timeout_s=10.0)
        try:
            if role is Role.FFN:
                FFNWorker(conn, expert_fn=identity_experts).run()
            else:
                errors.append(round_trip_error(conn, instance, seed=instance))
                conn.announce_shutdown()
        finally:
            conn.close()
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_connectors_created_one_after_another_do_not_mix(backend):
    attn, _ = launch(_consecutive_program, 2, args=(backend,), timeout_s=90)
    assert len(attn) == 3 and max(attn) < 0.1


def _attention_fails_program(ctx, backend):
    conn, role, _ = connect(ctx, backend, timeout_s=10.0)
    if role is Role.FFN:
        with conn:
            return {"served": FFNWorker(conn, expert_fn=identity_experts).run()}
    start = time.monotonic()
    try:
        with conn:  # no announce_shutdown(): the error path must release the FFN ranks
            round_trip_error(conn, 0, seed=0)
            raise RuntimeError("attention model failed at layer 1")
    except RuntimeError as err:
        return {"error": str(err), "elapsed": time.monotonic() - start}


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_error_before_shutdown_releases_the_ffn_and_surfaces(backend):
    attn, ffn = launch(_attention_fails_program, 2, args=(backend,), timeout_s=60)
    assert attn["error"] == "attention model failed at layer 1"  # the original error surfaces
    assert attn["elapsed"] < 5.0, attn  # close() did not wait out a barrier timeout
    assert ffn["served"] == 1  # the FFN loop ended (shutdown announced by close)


def test_liveness_is_unknown_outside_this_host_and_pid_namespace():
    from afd_cupy.runtime import handshake

    here = handshake.PeerProcess(0, os.getpid(), handshake.socket.gethostname(),
                                 handshake._pid_namespace())
    assert here.is_alive() is True
    assert handshake.PeerProcess(0, os.getpid(), "another-host", here.pid_namespace).is_alive() is None
    assert handshake.PeerProcess(0, os.getpid(), here.host, "pid:[1]").is_alive() is None
    gone = handshake.PeerProcess(0, 2**22 + 12345, here.host, here.pid_namespace)  # above pid_max
    assert gone.is_alive() is False



def test_an_exited_process_not_yet_reaped_is_dead():
    # a launcher reaps its children only now and then: a killed rank stays a zombie meanwhile,
    # and kill(pid, 0) still succeeds on it
    import subprocess
    import sys

    from afd_cupy.runtime import handshake

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    peer = handshake.PeerProcess(0, child.pid, handshake.socket.gethostname(), handshake._pid_namespace())
    try:
        deadline = time.monotonic() + 30
        while peer.is_alive() and time.monotonic() < deadline:  # exits within ~0.1 s, never reaped
            time.sleep(0.01)
        assert peer.is_alive() is False
        assert child.poll() == 0  # it was a zombie until this reaped it
    finally:
        child.wait()

# --- 2A2F: one rank of a role dies, its peers of the other role keep serving the survivors ---
def _ids_for(conn, num_tokens, ffn_rank, seed):
    """Inputs whose top-k experts all live on ``ffn_rank``."""
    hidden, _, _ = seeded_inputs(conn, num_tokens, seed)
    owned = conn.topology.owned_experts(ffn_rank)
    logits = torch.randn(num_tokens, conn.model.num_experts, generator=torch.Generator().manual_seed(seed))
    logits[:, owned.start:owned.stop] += 50.0
    weights, ids = conn.select_experts(logits.to(conn.device))
    return hidden, ids, weights


def _partial_death_program(ctx, backend, victim):
    model = ModelConfig(**{**{f: getattr(FAULT_MODEL, f) for f in FAULT_MODEL.__dataclass_fields__},
                           "num_shared_experts": 0})
    conn, role, role_rank = connect(ctx, backend, 2, 2, model=model)
    out = {"rank": ctx.rank}
    try:
        if ctx.rank == victim:
            if role is Role.FFN:
                FFNWorker(conn, expert_fn=lambda item: os.kill(os.getpid(), signal.SIGKILL)).run()
            else:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)
        if victim == 0 and role is Role.ATTENTION:
            # the surviving replica goes on once the victim is gone: otherwise it may finish
            # and enter close()'s collective barrier while the victim still runs (its path open
            # warms the planners up), and that barrier rightly waits for a healthy-looking peer
            victim_process = next(p for p in conn._peer_processes if p.world_rank == victim)
            deadline = time.monotonic() + 30
            while victim_process.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert victim_process.is_alive() is False
        if role is Role.FFN:
            try:
                out["served"] = FFNWorker(conn, expert_fn=identity_experts).run()
            except PeerLostError as err:
                out["lost"] = tuple(err.peers)
            return out
        errors = []
        for layer in range(4):  # tokens routed only to FFN rank 1 (the survivor when victim is FFN 0)
            hidden, ids, weights = _ids_for(conn, 6, ffn_rank=1, seed=10 * ctx.rank + layer)
            out_rows = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, layer))
            errors.append(float((out_rows.float() - hidden.float() * weights.sum(1, keepdim=True)).abs().max()))
        out["errors"] = errors
        if victim == 2:  # FFN rank 0 died: a layer routed to it times out, naming it
            hidden, ids, weights = _ids_for(conn, 6, ffn_rank=0, seed=99)
            try:
                conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 5))
            except PeerTimeoutError as err:
                out["timeout_peer"] = err.peer
        conn.announce_shutdown()
        return out
    finally:
        conn.close()
        out["segments"] = _job_segments(ctx.job_id)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("victim", [0, 2], ids=["attention0", "ffn0"])
def test_2a2f_one_rank_dies_and_the_others_keep_serving(backend, victim):
    results = launch(_partial_death_program, 4, args=(backend, victim), timeout_s=90,
                     expected_deaths={victim})
    assert isinstance(results[victim], DiedAsExpected)
    attn = [r for r in results[:2] if not isinstance(r, DiedAsExpected)]
    ffn = [r for r in results[2:] if not isinstance(r, DiedAsExpected)]
    for a in attn:  # every surviving replica's layers on the surviving FFN rank are right
        assert len(a["errors"]) == 4 and max(a["errors"]) < 0.1, a
        assert a["segments"] == []
    if victim == 0:  # both FFN ranks served replica 1, then report replica 0 as lost
        assert [f.get("lost") for f in ffn] == [(0,), (0,)], ffn
    else:
        assert attn[0]["timeout_peer"] == 0 and attn[1]["timeout_peer"] == 0, attn
        assert ffn[0]["served"] >= 8, ffn  # FFN rank 1 served both replicas


class _Peer:
    def __init__(self, world_rank, alive):
        self.world_rank, self._alive = world_rank, alive

    def is_alive(self):
        return self._alive


class _ClosingPath:
    def __init__(self):
        self.healthy = []

    def close(self, *, peers_healthy):
        self.healthy.append(peers_healthy)


@pytest.mark.parametrize("peer_failed,liveness,healthy", [
    (False, (True, True), True),
    (True, (True, True), True),     # a timed-out wait whose peers all still run (the soak's case)
    (True, (True, None), False),    # ... and a peer this host cannot see: it may be gone
    (False, (True, None), True),    # no failure: unknown liveness alone changes nothing
    (False, (True, False), False),  # a dead peer
    (True, (False, None), False),
])
def test_close_waits_for_live_peers_after_a_recovered_timeout(peer_failed, liveness, healthy):
    # The closing barrier is short (UNHEALTHY_CLOSE_S) only when a peer is gone or may be. A
    # replica that recovered from one timeout and finished first used to close "unhealthy",
    # give up on its late peers after 0.5 s, and leave them in NVSHMEM's collective teardown
    conn = object.__new__(AFDConnector)
    conn.role, conn.role_rank, conn._closed = Role.ATTENTION, 0, False
    conn.endpoint = SimpleNamespace(shutdown_announced=True, peer_failed=peer_failed)
    conn._peer_processes = [_Peer(rank + 1, alive) for rank, alive in enumerate(liveness)]
    conn.path = _ClosingPath()
    conn.close()
    conn.close()  # idempotent
    assert conn.path.healthy == [healthy]


# --- a replica that recovered from a timeout and finished first: one closing verdict ---------
def _record_agreed_barriers(log):
    """Wrap the heaps' agreed_barrier (both backends) to log (name tail, timeout, verdict)."""
    from afd_cupy.heap import host as host_heap
    from afd_cupy.heap import nvshmem as nvshmem_heap

    for module in (host_heap, nvshmem_heap):
        original = module.agreed_barrier

        def recorded(store, name, world_size, timeout_s, _original=original):
            verdict = _original(store, name, world_size, timeout_s)
            log.append((name.rsplit("/", 1)[-1], timeout_s, verdict))
            return verdict

        module.agreed_barrier = recorded


def _early_finisher_program(ctx, backend):
    log = []
    _record_agreed_barriers(log)
    conn, role, role_rank = connect(ctx, backend, 2, 1)
    out = {"rank": ctx.rank}
    try:
        if role is Role.FFN:
            stalled = []

            def stall_replica_1_once(item):
                if item.src_rank == 1 and not stalled:
                    stalled.append(item.layer_idx)
                    time.sleep(1.6 * FAULT_TIMEOUT_S)
                return identity_experts(item)

            out["served"] = FFNWorker(conn, expert_fn=stall_replica_1_once).run()
            return out
        if role_rank == 1:  # times out once, recovers (the stall is over), finishes first
            try:
                round_trip_error(conn, 0, seed=0)
            except PeerTimeoutError as err:
                out["timeout"] = err.peer
            out["errors"] = [round_trip_error(conn, layer, seed=layer) for layer in (1, 2)]
            store_publish(ctx.store(), "test/replica1_recovered", b"1")
        else:  # starts once the FFN's stall is over, reaches close() well after replica 1
            store_fetch(ctx.store(), "test/replica1_recovered", 30.0)
            out["errors"] = [round_trip_error(conn, layer, seed=10 + layer) for layer in range(3)]
            time.sleep(1.5)  # > UNHEALTHY_CLOSE_S after replica 1 entered its closing barrier
        conn.announce_shutdown()
        return out
    finally:
        conn.close()
        out["close"] = [entry for entry in log if entry[0] == "close"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_replica_that_recovered_from_a_timeout_closes_with_its_live_peers(backend):
    # The cuda soak's hang (session 13): replica 1 timed out once, finished first and closed
    # with the short "unhealthy" barrier; it gave up after 0.5 s and left, and the others then
    # entered NVSHMEM's collective teardown without it. Every peer is alive, so replica 1 now
    # waits for them (startup_timeout_s), and every rank gets the same verdict: go.
    results = launch(_early_finisher_program, 3, args=(backend,), timeout_s=90)
    attn0, attn1, ffn = results
    assert attn1["timeout"] == 0, attn1
    assert max(attn0["errors"] + attn1["errors"]) < 0.1, results
    for r in results:
        assert [verdict for _, _, verdict in r["close"]] == [True], r
    assert attn1["close"][0][1] == 30.0, attn1  # the full start-up bound, not UNHEALTHY_CLOSE_S
