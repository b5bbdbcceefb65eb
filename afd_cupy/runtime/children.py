"""The launcher's children: what each spawned rank runs first, and how the launcher collects
their reports, notices silent deaths and hangs, and stops them.

A child (:func:`child_main`) arms its orphan guard (:mod:`afd_cupy.runtime.orphan`: it dies with its
launcher), sets its environment, unpickles and runs ``fn``, and puts ``(local index, ok,
payload)`` on the results queue. The launcher waits on a :class:`Job` (:func:`wait_for_job`),
takes the Python stacks of the ranks that hang (:func:`collect_stacks`), and always ends with
:func:`stop_all`.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from typing import Any

from afd_cupy.errors import AfdError
from afd_cupy.runtime import orphan

_TERMINATE_GRACE_S = 2.0
FAILURE_GRACE_S = 1.0  # after a first failure, time to collect the other ranks' reports
_POLL_S = 0.05
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # None where there is no SIGUSR1 (Windows)
_STACK_WAIT_S = 2.0  # how long a hung rank gets to write its stacks after the signal
_STACK_MAX_CHARS = 8000  # of each rank's dump kept in the failure text (innermost frames first)
_stack_file = None  # the child's open dump file (faulthandler writes to its descriptor)


class LaunchError(AfdError):
    """A launched process failed, died or timed out.

    ``failures`` maps rank -> explanation (traceback text, exit code, or "did not finish").
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


@dataclasses.dataclass(frozen=True)
class DiedAsExpected:
    """The result of a rank named in ``launch(expected_deaths=...)`` that died unreported."""

    rank: int
    exit_code: int


def child_main(rank: int, fn_args_blob: bytes, ctx, env: dict[str, str], results: Any,
               stack_path: str | None = None, parent_pid: int | None = None) -> None:
    """Entry point of a child: arm the orphan guard (the child dies with process
    ``parent_pid``, the launcher: :func:`afd_cupy.runtime.orphan.die_with_parent`), set ``env``, then
    unpickle and run ``fn(ctx, *args)`` (``ctx``: the rank's ProcessContext); report to the
    parent. ``stack_path``: where the Python stacks of every thread go when the parent sends
    SIGUSR1 (a rank that does not finish in time; :func:`collect_stacks`)."""
    global _stack_file
    if parent_pid is not None:
        orphan.die_with_parent(parent_pid)
    os.environ.update(env)
    if stack_path is not None and _STACK_SIGNAL is not None:
        _stack_file = open(stack_path, "w")  # noqa: SIM115 - open for the process's life
        faulthandler.register(_STACK_SIGNAL, file=_stack_file, all_threads=True)
    try:
        # Unpickled only now so that env (CUDA_VISIBLE_DEVICES, MPS, thread pools...) is set
        # before any import that fn's module triggers.
        fn, args = pickle.loads(fn_args_blob)
        _apply_torch_threads()
        payload = pickle.dumps(fn(ctx, *args))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, payload))


def _apply_torch_threads() -> None:
    """torch imported by fn's module has read ``OMP_NUM_THREADS`` already; set it explicitly
    anyway (a torch build that ignores the variable still gets the count). A torch imported
    later reads the variable itself."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) >= 1:
        torch.set_num_threads(int(value))


class Job:
    """Bookkeeping of one launch: children, reports, failures."""

    def __init__(self, nprocs: int, processes: list, results: Any, expected_deaths=()):
        self.nprocs = nprocs
        self.processes = processes
        self.results = results
        self.expected_deaths = frozenset(expected_deaths)
        self.values: dict[int, Any] = {}
        self.failures: dict[int, str] = {}
        self.timed_out: list[int] = []  # ranks still running at the deadline

    def pending(self) -> list[int]:
        return [r for r in range(self.nprocs) if r not in self.values and r not in self.failures]

    def drain(self, timeout_s: float) -> None:
        """Collect the reports that arrive within ``timeout_s`` (returns after the first)."""
        try:
            self._record(*self.results.get(timeout=timeout_s))
            while True:
                self._record(*self.results.get_nowait())
        except queue.Empty:
            return

    def _record(self, rank: int, ok: bool, payload) -> None:
        if ok:
            self.values[rank] = pickle.loads(payload)
        else:
            self.failures[rank] = f"rank {rank} raised:\n{payload}"

    def note_silent_deaths(self) -> None:
        """Ranks whose process ended without a report: drain once more, then record them."""
        dead = [r for r in self.pending() if self.processes[r].exitcode is not None]
        if not dead:
            return
        self.drain(0.5)  # a report written just before exit may still be in the pipe
        for rank in dead:
            if rank in self.pending():
                code = self.processes[rank].exitcode
                if rank in self.expected_deaths:
                    self.values[rank] = DiedAsExpected(rank, code)
                else:
                    self.failures[rank] = f"rank {rank} died without reporting (exit code {code})"


def wait_for_job(job: Job, deadline: float, timeout_s: float, joining=None) -> None:
    """Wait for every rank, stopping shortly after the first failure or at ``deadline``
    (``time.monotonic()``; the job's ``timeout_s`` is what a rank that misses it is told).

    Until ``joining`` (an :class:`afd_cupy.runtime.rendezvous.Rendezvous`, or None) is complete
    (every world rank of the job joined) its deadline applies too: past it, its PeerTimeoutError naming the missing world ranks is raised, unless a
    local rank failed first (then that failure is reported as usual)."""
    failure_deadline = None
    while job.pending():
        now = time.monotonic()
        if now >= deadline:
            job.timed_out = job.pending()
            for rank in job.timed_out:
                job.failures[rank] = f"rank {rank} did not finish within {timeout_s:.1f} s"
            return
        if job.failures and failure_deadline is None:
            failure_deadline = now + FAILURE_GRACE_S
        if failure_deadline is not None and now >= failure_deadline:
            return
        if joining is not None and failure_deadline is None and now >= joining.deadline \
                and not joining.poll():
            raise joining.error()
        job.drain(min(_POLL_S, deadline - now))
        job.note_silent_deaths()


def collect_stacks(job: Job, stack_paths: list) -> None:
    """Append the Python stacks of every thread of each rank that timed out to its failure
    text: signal the live ones (faulthandler, registered by :func:`child_main`), wait until
    each dump stops growing (at most ``_STACK_WAIT_S``), keep its first ``_STACK_MAX_CHARS``.
    A rank blocked in C (a CUDA synchronize, a lock) is dumped too: faulthandler writes from
    the signal handler without the GIL."""
    if _STACK_SIGNAL is None:
        return
    hung = []
    for rank in job.timed_out:
        if not job.processes[rank].is_alive():
            continue
        try:
            os.kill(job.processes[rank].pid, _STACK_SIGNAL)
        except OSError:  # it exited just now
            continue
        hung.append(rank)
    sizes: dict[int, int] = {}
    settled: set[int] = set()
    deadline = time.monotonic() + _STACK_WAIT_S
    while len(settled) < len(hung) and time.monotonic() < deadline:
        time.sleep(2 * _POLL_S)
        for rank in hung:
            size = _file_size(stack_paths[rank])
            if size > 0 and sizes.get(rank) == size:
                settled.add(rank)
            sizes[rank] = size
    for rank in hung:
        text = _read_text(stack_paths[rank])
        if len(text) > _STACK_MAX_CHARS:
            text = text[:_STACK_MAX_CHARS] + "\n..."
        job.failures[rank] += (f"; the Python stacks of its threads then:\n{text.rstrip()}" if text.strip()
                               else "; it wrote no stack dump on SIGUSR1")


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as dump:
            return dump.read()
    except OSError:
        return ""


def failure_message(job: Job, job_id: str) -> str:
    lines = [f"launch of {job.nprocs} processes (job {job_id}) failed on ranks "
             f"{sorted(job.failures)}"]
    for rank in sorted(job.failures):
        lines.append(f"--- {job.failures[rank]}")
    unfinished = job.pending()
    if unfinished:
        lines.append(f"--- ranks {unfinished} were terminated before finishing")
    return "\n".join(lines)


def stop_all(processes: list, exit_grace_s: float = 0.0) -> None:
    """Give the children ``exit_grace_s`` to exit on their own (after a clean run a rank
    that reported still tears its interpreter and libraries down: atexit handlers, CUDA),
    then terminate the rest, and kill the ones that ignore it within ``_TERMINATE_GRACE_S``."""
    deadline = time.monotonic() + exit_grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


