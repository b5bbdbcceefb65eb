"""The backends and (backend, wire mode) paths that tests parametrize over.

"host" runs everywhere (shared memory, threads); "cuda" needs a GPU (``cuda`` marker, conftest
turns a missing GPU into a skip); "cuda-put" is the cuda backend with
``ConnectorConfig(transport="put")`` (docs/design/put-transport.md): the same rules must hold
over NVSHMEM puts. The ids are the test ids (``test_x[host-dedup]``).
"""
from __future__ import annotations

import pytest

_DEVICE_BACKENDS = ("cuda", "cuda-put")


def _backend(name: str):
    marks = (pytest.mark.cuda,) if name in _DEVICE_BACKENDS else ()
    return pytest.param(name, id=name, marks=marks)


def _path(backend: str, wire_mode: str):
    marks = (pytest.mark.cuda,) if backend in _DEVICE_BACKENDS else ()
    name = backend if wire_mode == "pair" else f"{backend}-{wire_mode}"
    return pytest.param(backend, wire_mode, id=name, marks=marks)


#: every backend: host, cuda, cuda-put
BACKENDS = [_backend(name) for name in ("host", "cuda", "cuda-put")]
#: the backends over the direct transport only (host, cuda)
DIRECT_BACKENDS = [_backend(name) for name in ("host", "cuda")]
#: (backend, wire_mode) for every backend in both wire modes
PATHS = [_path(backend, mode) for backend in ("host", "cuda", "cuda-put") for mode in ("pair", "dedup")]
#: (backend, wire_mode) over the direct transport only
DIRECT_PATHS = [_path(backend, mode) for backend in ("host", "cuda") for mode in ("pair", "dedup")]
