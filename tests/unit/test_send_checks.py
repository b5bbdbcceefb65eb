"""The Attention endpoint's argument checks of ``send_attn_output``, on the CPU, with a stand-in
data path: what a send accepts, and the ValueError naming the value for everything it refuses.
The checks run on every send, so their common case takes a short path (``_check_index``,
``check_device``); these cases pin that the short path refuses nothing the full checks accept
and accepts nothing they refuse."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from afd_cupy.attention.endpoint import AttentionEndpoint, check_device
from afd_cupy.errors import CapacityError

HIDDEN, TOP_K, LAYERS, STAGES, TOKEN_CAP = 16, 2, 4, 2, 8


class _Path:
    """A data path that sends nothing and records what reached it."""

    owns_routing = True

    def __init__(self, device):
        self.device = device
        self.dispatched = []

    def dispatch(self, hidden, topk_ids, topk_weights, *, layer_idx, stage_idx, ring):
        self.dispatched.append((layer_idx, stage_idx, ring))
        return None

    def combine(self, *args, **kwargs):
        return None


def _endpoint(device=torch.device("cpu")) -> AttentionEndpoint:
    model = SimpleNamespace(num_layers=LAYERS, hidden_size=HIDDEN, top_k=TOP_K)
    layout = SimpleNamespace(is_dedup=False, ring_depth=2 * STAGES, token_cap=TOKEN_CAP)
    return AttentionEndpoint(_Path(device), model=model, config=SimpleNamespace(num_stages=STAGES),
                             layout=layout, torch_dtype=torch.bfloat16, out_scale=1.0,
                             ffn_peers=SimpleNamespace(gone=frozenset()))


def _args(tokens=3, *, ids_dtype=torch.int32, weights_dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 4, (tokens, TOP_K), generator=gen).to(ids_dtype)
    weights = torch.rand(tokens, TOP_K, generator=gen).to(weights_dtype)
    return hidden.to(device), ids.to(device), weights.to(device)


@pytest.mark.parametrize("layer,stage", [(0, 0), (LAYERS - 1, STAGES - 1), (np.int64(2), np.int32(1))])
@pytest.mark.parametrize("ids_dtype,weights_dtype", [(torch.int32, torch.float32), (torch.int64, torch.bfloat16),
                                                     (torch.int16, torch.float64), (torch.uint8, torch.float16)])
def test_a_send_accepts_every_integer_index_and_routing_dtype(layer, stage, ids_dtype, weights_dtype):
    endpoint = _endpoint()
    handle = endpoint.send(*_args(ids_dtype=ids_dtype, weights_dtype=weights_dtype), layer, stage)
    assert (handle.layer_idx, handle.stage_idx) == (int(layer), int(stage))
    assert type(handle.layer_idx) is int and type(handle.stage_idx) is int
    assert endpoint.path.dispatched == [(int(layer), int(stage), handle.ring)]
    endpoint.recv(handle)
    assert endpoint.pending_rings() == ()


def test_a_send_accepts_zero_tokens_and_the_token_cap():
    endpoint = _endpoint()
    for tokens in (0, TOKEN_CAP):
        endpoint.recv(endpoint.send(*_args(tokens), 0, 0))
    assert len(endpoint.path.dispatched) == 2


def _refusal(**change):
    """The arguments of a good send with ``change`` applied."""
    hidden, ids, weights = _args()
    args = {"hidden": hidden, "topk_ids": ids, "topk_weights": weights, "layer_idx": 1, "stage_idx": 0}
    args.update(change)
    return args


REFUSED = [
    (_refusal(layer_idx=True), r"layer_idx must be an int, got bool True"),
    (_refusal(layer_idx=1.0), r"layer_idx must be an int, got float 1.0"),
    (_refusal(layer_idx=np.float32(1)), r"layer_idx must be an int, got float32"),
    (_refusal(layer_idx="1"), r"layer_idx must be an int, got str '1'"),
    (_refusal(layer_idx=LAYERS), rf"layer_idx={LAYERS} outside \[0, {LAYERS}\)"),
    (_refusal(layer_idx=-1), rf"layer_idx=-1 outside \[0, {LAYERS}\)"),
    (_refusal(layer_idx=np.int64(-3)), rf"layer_idx=-3 outside \[0, {LAYERS}\)"),
    (_refusal(stage_idx=STAGES), rf"stage_idx={STAGES} outside \[0, {STAGES}\)"),
    (_refusal(stage_idx=np.bool_(False)), r"stage_idx must be an int, got bool"),
    (_refusal(hidden=np.zeros((3, HIDDEN))), rf"hidden must be a \[num_tokens, {HIDDEN}\] tensor, got \(3, {HIDDEN}\)"),
    (_refusal(hidden=[[0.0] * HIDDEN]), r"hidden must be a .* tensor, got list"),
    (_refusal(hidden=torch.zeros(3, HIDDEN + 1, dtype=torch.bfloat16)), r"got torch.Size\(\[3, 17\]\)"),
    (_refusal(hidden=torch.zeros(3, 1, HIDDEN, dtype=torch.bfloat16)), r"got torch.Size\(\[3, 1, 16\]\)"),
    (_refusal(hidden=torch.zeros(3, HIDDEN)), r"hidden has dtype torch.float32, the model dtype is torch.bfloat16"),
    (_refusal(hidden=torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device="meta")),
     r"hidden is on meta, this connector's tensors live on cpu"),
    (_refusal(topk_ids=np.zeros((3, TOP_K), np.int32)), r"topk_ids must be a torch.Tensor, got ndarray"),
    (_refusal(topk_ids=torch.zeros(3, TOP_K + 1, dtype=torch.int32)), r"topk_ids must have shape \(3, 2\), got \(3, 3\)"),
    (_refusal(topk_ids=torch.zeros(4, TOP_K, dtype=torch.int32)), r"topk_ids must have shape \(3, 2\), got \(4, 2\)"),
    (_refusal(topk_ids=torch.zeros(3 * TOP_K, dtype=torch.int32)), r"topk_ids must have shape \(3, 2\), got \(6,\)"),
    (_refusal(topk_ids=torch.zeros(3, TOP_K)), r"topk_ids has wrong dtype torch.float32 \(expected an integer dtype\)"),
    (_refusal(topk_ids=torch.zeros(3, TOP_K, dtype=torch.bool)), r"topk_ids has wrong dtype torch.bool"),
    (_refusal(topk_ids=torch.zeros(3, TOP_K, dtype=torch.complex64)), r"topk_ids has wrong dtype torch.complex64"),
    (_refusal(topk_ids=torch.zeros(3, TOP_K, dtype=torch.int32, device="meta")), r"topk_ids is on meta"),
    (_refusal(topk_weights=torch.zeros(3, TOP_K, dtype=torch.int32)),
     r"topk_weights has wrong dtype torch.int32 \(expected a float dtype\)"),
    (_refusal(topk_weights=torch.zeros(3, TOP_K, dtype=torch.bool)), r"topk_weights has wrong dtype torch.bool"),
    (_refusal(topk_weights=torch.zeros(3, TOP_K, dtype=torch.complex64)), r"topk_weights has wrong dtype torch.complex64"),
    (_refusal(topk_weights=torch.zeros(3, 1)), r"topk_weights must have shape \(3, 2\), got \(3, 1\)"),
    (_refusal(topk_weights=None), r"topk_weights must be a torch.Tensor, got NoneType"),
]


@pytest.mark.parametrize("args,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_a_refused_send_names_the_value_and_reaches_nothing(args, message):
    endpoint = _endpoint()
    with pytest.raises(ValueError, match=message):
        endpoint.send(args["hidden"], args["topk_ids"], args["topk_weights"], args["layer_idx"], args["stage_idx"])
    assert endpoint.path.dispatched == [] and endpoint.pending_rings() == ()


def test_a_send_over_the_token_cap_raises_capacity_error():
    endpoint = _endpoint()
    with pytest.raises(CapacityError, match=rf"{TOKEN_CAP + 1}"):
        endpoint.send(*_args(TOKEN_CAP + 1), 0, 0)
    assert endpoint.path.dispatched == []


def test_check_device_compares_the_index_only_where_the_connector_has_one():
    cpu = torch.zeros(1)
    check_device("x", cpu, torch.device("cpu"))
    for device in (torch.device("cuda"), torch.device("cuda", 0)):
        with pytest.raises(ValueError, match=r"x is on cpu, this connector's tensors live on cuda"):
            check_device("x", cpu, device)
    # A tensor's device always has an index on cuda; a connector's device without one takes any.
    fake = SimpleNamespace(device=torch.device("cuda", 1))
    check_device("x", fake, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"x is on cuda:1, this connector's tensors live on cuda:0"):
        check_device("x", fake, torch.device("cuda", 0))
