"""Every backend implements the whole asymmetric seam (afd_cupy.backends.base.AttentionPath and
FFNPath) with the same call signatures, so the connector never needs to know which one it holds."""
import inspect

import pytest

from afd_cupy.backends import cuda, cuda_attention, cuda_ffn, host, host_ffn
from afd_cupy.backends.base import BACKEND_MODULES, AttentionPath, FFNPath


def _methods(protocol):
    return {name for cls in protocol.__mro__ if cls.__module__ == protocol.__module__
            for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize("protocol,path_cls", [
    (AttentionPath, host.HostAttentionPath), (AttentionPath, cuda_attention.CudaAttentionPath),
    (FFNPath, host_ffn.HostFFNPath), (FFNPath, cuda_ffn.CudaFFNPath)],
    ids=["host-attention", "cuda-attention", "host-ffn", "cuda-ffn"])
def test_backend_implements_every_data_path_method_with_its_signature(protocol, path_cls):
    methods = _methods(protocol)
    common = {"check_errors", "announce_shutdown", "close"}
    role = ({"dispatch", "combine", "sent_to", "order_graph_replay"} if protocol is AttentionPath
            else {"wait_any", "item_views", "reply", "pending_arrivals", "reply_seq_counters"})
    assert methods >= common | role
    for name in methods:
        method = getattr(path_cls, name, None)
        assert callable(method), f"{path_cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got == want, (path_cls.__name__, name, got, want)
    # one role per path: an Attention rank holds no FFN step and an FFN rank no Attention step
    other = _methods(FFNPath if protocol is AttentionPath else AttentionPath) - common
    assert not [name for name in other if hasattr(path_cls, name)], path_cls.__name__


@pytest.mark.parametrize("name", sorted(BACKEND_MODULES))
def test_backend_modules_open_paths(name):
    module = __import__(BACKEND_MODULES[name], fromlist=["open_path"])
    assert callable(module.open_path) and callable(module.require_available)


class _FakeStream:
    """Stands in for ``cupy.cuda.Stream``: records how a foreign stream was wrapped."""

    def __init__(self, how, handle, device_id=None):
        self.how, self.handle, self.device_id = how, handle, device_id


def _fake_cupy(with_from_external: bool):
    class Stream:
        pass

    if with_from_external:  # CuPy >= 14
        def from_external(obj):
            version, handle = obj.__cuda_stream__()
            assert version == 0
            return _FakeStream("from_external", handle)

        Stream.from_external = staticmethod(from_external)

    def external_stream(handle, device_id=-1):
        return _FakeStream("ExternalStream", handle, device_id)

    cuda_ns = type("cuda", (), {"Stream": Stream, "ExternalStream": staticmethod(external_stream)})
    return type("cp", (), {"cuda": cuda_ns})


@pytest.mark.parametrize("with_from_external", [True, False], ids=["cupy14", "cupy13"])
def test_cupy_stream_wraps_the_raw_handle_through_the_stream_protocol_when_cupy_has_it(with_from_external):
    handle = 0x7F00_1234_5678
    stream = cuda.cupy_stream(_fake_cupy(with_from_external), handle, 3)
    assert stream.handle == handle
    if with_from_external:  # the deprecated ExternalStream is not touched
        assert (stream.how, stream.device_id) == ("from_external", None)
    else:
        assert (stream.how, stream.device_id) == ("ExternalStream", 3)
