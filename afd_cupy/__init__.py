"""afd_cupy: asynchronous Attention-FFN disaggregation for MoE inference.

Importing the package has no side effects and needs no GPU: CuPy, torch and NVSHMEM are
loaded lazily by the parts that need them. Logs go to ``logging.getLogger("afd_cupy")``.
"""
from __future__ import annotations

import logging

from afd_cupy import old_paths
from afd_cupy.errors import (  # noqa: F401
    AfdError, BackendUnavailableError, CapacityError, ConfigError, ConnectorShutdown,
    GeometryMismatchError, HeapError, NvshmemError, PeerTimeoutError, ProtocolError,
    RingExhaustedError, TopologyError, WireError,
)

__version__ = "0.1.0"

old_paths.install()  # the module paths from before the package was cut by role still import

logging.getLogger("afd_cupy").addHandler(logging.NullHandler())
