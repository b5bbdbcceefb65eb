"""Every backend implements the whole data-path seam (afd_cupy.backends.base.DataPath) with the
same call signatures, so the connector never needs to know which one it holds."""
import inspect

import pytest

from afd_cupy.backends import cuda, host
from afd_cupy.backends.base import BACKEND_MODULES, DataPath

METHODS = [name for name, value in vars(DataPath).items()
           if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("path_cls", [host.HostDataPath, cuda.CudaDataPath], ids=["host", "cuda"])
def test_backend_implements_every_data_path_method_with_its_signature(path_cls):
    assert set(METHODS) >= {"dispatch", "combine", "sent_to", "check_errors", "wait_any",
                            "item_views", "reply", "announce_shutdown", "close"}
    for name in METHODS:
        method = getattr(path_cls, name, None)
        assert callable(method), f"{path_cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(DataPath, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got == want, (path_cls.__name__, name, got, want)
    assert isinstance(path_cls.supports_nonblocking, bool)


@pytest.mark.parametrize("name", sorted(BACKEND_MODULES))
def test_backend_modules_open_paths(name):
    module = __import__(BACKEND_MODULES[name], fromlist=["open_path"])
    assert callable(module.open_path) and callable(module.require_available)
