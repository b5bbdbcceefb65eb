import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from afd_cupy.routing import planner

FIELDS = ("order", "route_table", "expert_counts", "rank_offsets", "pos")


@st.composite
def routing(draw):
    num_ffn = draw(st.integers(1, 5))
    epr = draw(st.integers(1, 6))
    num_experts = draw(st.integers((num_ffn - 1) * epr + 1, num_ffn * epr))  # may leave a padded tail
    top_k = draw(st.integers(1, min(4, num_experts)))
    num_tokens = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)]) \
        if num_tokens else np.zeros((0, top_k), np.int64)
    return ids.reshape(num_tokens, top_k), num_ffn, epr, num_experts, rng


@settings(max_examples=150, deadline=None)
@given(routing())
def test_numba_plan_equals_reference_and_properties(case):
    ids, num_ffn, epr, num_experts, _ = case
    plan = planner.plan_dispatch(ids, num_ffn, epr, num_experts)
    ref = planner.plan_dispatch_reference(ids, num_ffn, epr, num_experts)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(plan, name), getattr(ref, name), err_msg=name)
    num_tokens, top_k = ids.shape
    # every partial routed exactly once
    assert sorted(plan.order.tolist()) == list(range(num_tokens * top_k))
    assert plan.rank_offsets[0] == 0 and plan.rank_offsets[-1] == num_tokens * top_k
    padded = plan.expert_counts[num_experts:]
    assert not padded.any()  # padded tail gets zero counts
    for r in range(num_ffn):
        seg = plan.rank_route_table(r)
        experts = ids[seg[:, 0], seg[:, 1]] if len(seg) else np.zeros(0, int)
        assert ((experts // epr) == r).all()  # only tokens that chose this rank's experts
        assert (np.diff(experts) >= 0).all()  # grouped by local expert
        counts = plan.rank_counts(r)
        assert counts.sum() == plan.routed_count(r) == len(seg)
        np.testing.assert_array_equal(np.bincount(experts - r * epr, minlength=epr), counts)
        for e in range(epr):  # stable: token order inside each group
            tok = seg[experts == r * epr + e]
            assert (np.diff(tok[:, 0] * top_k + tok[:, 1]) > 0).all()
    # pos points back at the partial
    for t in range(num_tokens):
        for k in range(top_k):
            r = ids[t, k] // epr
            assert tuple(plan.rank_route_table(r)[plan.pos[t, k]]) == (t, k)


@settings(max_examples=60, deadline=None)
@given(routing(), st.booleans())
def test_identity_experts_recombine_to_weighted_sum(case, use_shared):
    ids, num_ffn, epr, _, rng = case
    num_tokens, top_k = ids.shape
    hidden = 5
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    w = rng.random((num_tokens, top_k)).astype(np.float32)
    plan = planner.plan_dispatch(ids, num_ffn, epr)
    routed = [x[plan.rank_route_table(r)[:, 0]] for r in range(num_ffn)]  # identity expert
    shared = [x[planner.shared_split(num_tokens, num_ffn, r)] * 2 for r in range(num_ffn)] if use_shared else None
    expected = x * w.sum(axis=1, keepdims=True) + (2 * x if use_shared else 0)
    out = np.full((num_tokens, hidden), np.nan, np.float32)
    planner.combine(out, ids, w, plan.pos, epr, routed, shared, out_scale=1.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    ref = planner.combine_reference(ids, w, plan.pos, epr, routed, shared)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_combine_random_experts_and_scale():
    rng = np.random.default_rng(7)
    num_tokens, top_k, num_ffn, epr, hidden = 50, 3, 3, 4, 16
    ids = np.stack([rng.choice(12, top_k, replace=False) for _ in range(num_tokens)])
    w = rng.random((num_tokens, top_k)).astype(np.float32)
    plan = planner.plan_dispatch(ids, num_ffn, epr)
    routed = [rng.standard_normal((plan.routed_count(r), hidden)).astype(np.float32) for r in range(num_ffn)]
    shared = [rng.standard_normal((planner.shared_count(num_tokens, num_ffn, r), hidden)).astype(np.float32)
              for r in range(num_ffn)]
    out = np.full((num_tokens, hidden), np.nan, np.float32)
    planner.combine(out, ids, w, plan.pos, epr, routed, shared, out_scale=2.5)
    ref = planner.combine_reference(ids, w, plan.pos, epr, routed, shared, out_scale=2.5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not np.isnan(out).any()


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_zero_and_one_token(num_tokens):
    ids = np.arange(num_tokens * 2).reshape(num_tokens, 2) % 6
    plan = planner.plan_dispatch(ids, 3, 2)
    assert plan.order.shape == (num_tokens * 2,)
    assert plan.rank_offsets.tolist() == ([0, 2, 2, 2] if num_tokens else [0, 0, 0, 0])


def test_empty_destination_and_uneven_experts():
    ids = np.array([[0, 1], [1, 2], [2, 0]])  # nothing for rank 2 (experts 6..8)
    plan = planner.plan_dispatch(ids, 3, 3, num_experts=8)
    assert plan.routed_count(2) == 0 and plan.rank_route_table(2).shape == (0, 2)
    assert plan.rank_counts(0).tolist() == [2, 2, 2]


def test_bad_ids_rejected():
    with pytest.raises(ValueError, match=r"values must lie in \[0, 8\), got min=0 max=8"):
        planner.plan_dispatch(np.array([[0, 8]]), 2, 4)
    with pytest.raises(ValueError, match=r"must be \[num_tokens, top_k\], got shape \(3,\)"):
        planner.plan_dispatch(np.array([0, 1, 2]), 2, 4)
    with pytest.raises(ValueError, match=r"integer array, got dtype float32"):
        planner.plan_dispatch(np.zeros((2, 2), np.float32), 2, 4)


def test_shared_split():
    assert planner.shared_split(7, 3, 0).tolist() == [0, 3, 6]
    assert planner.shared_split(7, 3, 2).tolist() == [2, 5]
    for n in range(0, 12):
        for f in range(1, 5):
            parts = [planner.shared_split(n, f, r) for r in range(f)]
            assert sorted(np.concatenate(parts).tolist()) == list(range(n))
            assert [len(p) for p in parts] == [planner.shared_count(n, f, r) for r in range(f)]


def test_planner_is_numba_compiled():
    import numba.core.registry
    planner.plan_dispatch(np.array([[0, 1]]), 1, 2)
    assert isinstance(planner._counting_plan, numba.core.registry.CPUDispatcher)
    assert planner._counting_plan.signatures  # compiled by the calls above
