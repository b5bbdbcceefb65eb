"""A launched rank dies with its launcher: no orphan runs on to the end of its work.

:func:`die_with_parent` (called first in every child of :func:`afd_cupy.runtime.launch.launch`) arms
two guards: on Linux the kernel sends :data:`DEATH_SIGNAL` when the parent dies
(``prctl(PR_SET_PDEATHSIG)``, through ctypes), and everywhere a daemon thread checks every
:data:`WATCH_INTERVAL_S` that the parent pid is still this process's parent (a rank whose main
thread is inside a long C call runs no Python signal handler until it returns; the thread
still runs whenever the GIL is free). Either guard unlinks the host heap's shared-memory
segments this process still owns (:func:`afd_cupy.heap.host.unlink_own_segments`: a rank
killed during heap set-up would leave them in ``/dev/shm``) and exits at once with
:data:`ORPHAN_EXIT_CODE`.

NOTE: the guard is for ranks a launcher spawned; a rank started by another launcher
(torchrun, SLURM) is that launcher's to reap.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger("afd_cupy")

#: the signal the kernel sends an armed child when its parent dies (catchable, so that the
#: child unlinks its segments first; SIGUSR1 is the launcher's stack-dump signal)
DEATH_SIGNAL = getattr(signal, "SIGUSR2", None)
#: how often the watchdog thread checks the parent pid (seconds)
WATCH_INTERVAL_S = 0.2
#: exit status of a rank that outlived its launcher
ORPHAN_EXIT_CODE = 86
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, *, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Make this process exit (unlinking its own segments) once process ``parent_pid`` is no
    longer its parent. Call it from the main thread (the death signal's handler is installed
    there; from another thread only the watchdog is armed). Not collective; returns at once,
    or exits when the parent is already gone."""
    if DEATH_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(DEATH_SIGNAL, _on_death_signal)
        _arm_death_signal(DEATH_SIGNAL)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        exit_orphaned(parent_pid)
    threading.Thread(target=_watch, args=(parent_pid, interval_s), daemon=True,
                     name="afd-orphan-watchdog").start()


def _arm_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)`` on Linux; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        # int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4,
        #           unsigned long arg5);
        rc = libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(signum)), ctypes.c_ulong(0),
                        ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError) as exc:
        logger.debug("afd_cupy: no prctl(PR_SET_PDEATHSIG) here (%s); the watchdog alone guards", exc)
        return False
    if rc != 0:
        logger.debug("afd_cupy: prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
        return False
    return True


def _on_death_signal(signum, frame) -> None:
    exit_orphaned(None)


def _watch(parent_pid: int, interval_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    exit_orphaned(parent_pid)


def exit_orphaned(parent_pid: int | None) -> None:
    """Unlink this process's own heap segments and exit with :data:`ORPHAN_EXIT_CODE` (no
    atexit handlers, no collective teardown: the job is gone)."""
    try:
        host_heap = sys.modules.get("afd_cupy.heap.host")  # not loaded: no segment to unlink
        removed = host_heap.unlink_own_segments() if host_heap is not None else []
        logger.warning("afd_cupy rank pid %d: its launcher%s died; exiting (unlinked %d "
                       "shared-memory segment(s))", os.getpid(),
                       "" if parent_pid is None else f" (pid {parent_pid})", len(removed))
    finally:
        os._exit(ORPHAN_EXIT_CODE)
