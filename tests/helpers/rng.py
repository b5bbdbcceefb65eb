"""Random generators seeded from the test id: fresh data per test, the same data on a rerun."""
from __future__ import annotations

import zlib

import numpy as np


def node_rng(request) -> np.random.Generator:
    """A generator seeded with the CRC32 of ``request.node.nodeid`` (reproducible per test)."""
    return np.random.default_rng(node_seed(request))


def node_seed(request) -> int:
    """The seed of :func:`node_rng` (CRC32 of the test id)."""
    return zlib.crc32(request.node.nodeid.encode())
