#!/usr/bin/env python3
"""A neighbor process that keeps one block spinning on the GPU, as an FFN rank's wait kernel
does while it waits for work: for ``tools/gpu_suite.sh mps1``, which times the round trip's
kernels alone, under MPS, at an SM share, and beside this spinner (issue #33: the dispatch
takes ~2x longer in a two-process step under MPS than in one process).

The spinner is ``afd_bench_clock`` (raw_kernels/probes/bench.cu: one thread reads
``%globaltimer`` and stores it with a system fence in a loop, for ``--seconds``) into a device
word, relaunched until the time is up. Its SM share is the process's
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``. Prints the spins it ran; exits 2 without a GPU.

    python3 tools/spin_neighbor.py --seconds 60 &
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

SPIN_NS = 2_000_000_000  # one launch spins 2 s; relaunched back to back


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to keep spinning")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    if not bc.num_visible_gpus():
        print("spin_neighbor needs a GPU")
        return 2
    import cupy as cp

    from afd_cupy import kernels

    kernel = kernels.get_kernel("probes/bench.cu", "afd_bench_clock")
    word = cp.zeros(1, cp.int64)
    stream = cp.cuda.Stream(non_blocking=True)
    deadline, launches = time.monotonic() + args.seconds, 0
    while time.monotonic() < deadline:
        spin_ns = int(min(SPIN_NS, max(1e6, (deadline - time.monotonic()) * 1e9)))
        kernel((1,), (32,), (cp.uint64(word.data.ptr), cp.int64(spin_ns)), stream=stream)
        stream.synchronize()
        launches += 1
    print(f"spin_neighbor: {launches} spins over {args.seconds:.1f} s "
          f"(share {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '100')} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
