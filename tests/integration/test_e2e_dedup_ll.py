"""End-to-end dedup-mode runs with ``ConnectorConfig(dedup_dispatch="ll")`` (the Attention side
dispatches with afd_dedup_dispatch_ll), through the real connector in real processes, against
the fp64 per-token MoE reference: the cases of tests/integration/test_e2e.py that exercise the dispatch
(topologies, 0 / 1 / token_cap tokens, stages, put peers, CUDA-graph replays, always_send).
The host backend ignores the knob (its one dispatch path is the reference); it runs the
topologies too, so the configuration's plumbing is covered without a GPU."""

import pytest

import test_e2e as e2e
from afd_cupy import kernels
from afd_cupy.config import ConnectorConfig

LL = ConnectorConfig(dedup_dispatch="ll")
BACKENDS = [pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
            pytest.param("cuda-put", id="cuda-put", marks=pytest.mark.cuda)]


def _ll_scenario(backend, model, num_attn, num_ffn, connector=LL, **kw):
    # the ll kernel must really be chosen for these shapes (else the run tests the fused one)
    assert kernels.ll_dedup_dispatch_fits(model.max_num_batched_tokens, model.top_k,
                                          model.num_experts, num_ffn)
    return e2e._scenario(backend, model, num_attn, num_ffn, "dedup", connector=connector, **kw)


@pytest.mark.parametrize("backend", [pytest.param("host", id="host")] + BACKENDS)
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2), (2, 1), (1, 2), (3, 2)])
def test_ll_topologies_match_reference(backend, num_attn, num_ffn):
    e2e._run(_ll_scenario(backend, e2e._model(), num_attn, num_ffn, num_tokens=40))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ll_zero_one_and_many_tokens(backend):
    model = e2e._model(num_layers=3, max_num_batched_tokens=512)  # 512 = token_cap: full slots
    attn, ffn = e2e._run(_ll_scenario(backend, model, 2, 2, tokens=((0, 1, 512), (1, 0, 300))))
    layers_served = {(src, layer) for r in ffn for (src, layer, *_rest) in r["history"]}
    assert (0, 0) not in layers_served and (1, 1) not in layers_served  # empty: never sent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ll_dtypes_with_routed_scaling_and_stages(backend, dtype):
    model = e2e._model(dtype=dtype, routed_scaling_factor=2.5)
    cfg = ConnectorConfig(dedup_dispatch="ll", async_moe_ubatching=True, async_moe_num_ubatches=2)
    e2e._run(_ll_scenario(backend, model, 2, 2, connector=cfg, num_tokens=31))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ll_always_send_reaches_every_rank(backend):
    model = e2e._model(top_k=1, num_shared_experts=0)
    attn, ffn = e2e._run(_ll_scenario(backend, model, 1, 2, num_tokens=1, always_send=True))
    assert [r["served"] for r in ffn] == [2, 2]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "cuda-put"])
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2)])
def test_ll_attention_layers_replayed_from_cuda_graphs(backend, num_attn, num_ffn):
    replays, model = 3, e2e._model(num_layers=3)
    attn, ffn = e2e._run(_ll_scenario(backend, model, num_attn, num_ffn, num_tokens=40,
                                      graph_replays=replays))
    assert sum(r["served"] for r in ffn) == num_attn * model.num_layers * replays * num_ffn
