"""The route-table verdict of afd_dedup_expand, on the CPU: its numpy model
(``dedup_reference.expand_verdict_reference``) against ``wire.check_route_table``, the decoder
``wire.route_table_error``, and the rule codes of raw_kernels/ffn/dedup_ffn.cuh (the expand's device
code, shared by dedup_ffn.cu and ffn_graph_rows.cu) against wire.py.
The device kernel itself is compared with the same model in test_kernels_cuda_dedup_ffn.py.
"""
import re

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.errors import WireError
from afd_cupy.testing import dedup_reference as ref

from helpers import kernels as kh

_RULES = ("TOKEN", "SHARED", "PACKING", "RANGE", "DUPLICATE", "COUNT")


def _message(rng, *, num_tokens, num_ffn, top_k, epr, has_shared, ffn_rank=0):
    """(table, T, P, S) of FFN rank ``ffn_rank``'s message for random ids (numpy references)."""
    ids = rng.integers(0, num_ffn * epr, (num_tokens, top_k)).astype(np.int32)
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    plan = ref.plan_reference(ids, num_ffn, epr, has_shared=has_shared)
    hidden = np.zeros((num_tokens, 4), np.uint16)
    table, _ = ref.scatter_reference(plan, hidden, ids, weights, ffn_rank)
    return table, num_tokens, plan.routed_count(ffn_rank), int(plan.shared_rows[ffn_rank])


def _record(verdict, *, peer=1, ring=0, layer=5) -> wire.StatusRecord:
    rule, row, column, expected, observed = verdict
    return wire.StatusRecord(wire.STATUS_BAD_HEADER, peer, column, ring, expected, observed, row,
                             rule, layer)


def test_rule_codes_of_the_kernel_match_wire_py():
    text = (kernels.KERNEL_DIR / "ffn" / "dedup_ffn.cuh").read_text()
    for user in ("ffn/dedup_ffn.cu", "ffn/ffn_graph_rows.cu"):  # both expansions use the one definition
        assert '#include "ffn/dedup_ffn.cuh"' in (kernels.KERNEL_DIR / user).read_text(), user
        assert "ROUTE_FAULT_TOKEN =" not in (kernels.KERNEL_DIR / user).read_text(), user
    parsed = dict(re.findall(r"constexpr\s+afd_i64\s+(ROUTE_FAULT_\w+)\s*=\s*(\d+)\s*;", text))
    assert {name: int(v) for name, v in parsed.items()} == \
        {f"ROUTE_FAULT_{r}": getattr(wire, f"ROUTE_FAULT_{r}") for r in _RULES}


@pytest.mark.parametrize("seed", range(6))
def test_valid_tables_pass(seed):
    rng = np.random.default_rng(seed)
    table, t, p, s = _message(rng, num_tokens=[1, 7, 40, 3, 64, 2][seed], num_ffn=1 + seed % 3,
                              top_k=[1, 2, 8][seed % 3], epr=3, has_shared=seed % 2)
    wire.check_route_table(table, num_tokens=t, routed_tokens=p, shared_tokens=s,
                           top_k=(table.shape[1] - 2) // 2)
    assert ref.expand_verdict_reference(table, num_tokens=t, routed_tokens=p, shared_tokens=s) is None


@pytest.mark.parametrize("fault", sorted(kh.ROUTE_TABLE_FAULTS))
@pytest.mark.parametrize("top_k,has_shared", [(2, 1), (4, 0), (8, 1)])
def test_each_fault_is_rejected_by_both_naming_the_same_row(fault, top_k, has_shared):
    def faulty(rng):
        table, t, p, s = _message(rng, num_tokens=40, num_ffn=2, top_k=top_k, epr=4, has_shared=has_shared)
        bad = table.copy()
        row = kh.ROUTE_TABLE_FAULTS[fault](bad, num_tokens=t, shared_tokens=s, routed_tokens=p)
        return None if row is None else (t, p, s, bad, row)

    _, (t, p, s, bad, row) = kh.first_seed_taking(faulty, top_k + 10 * has_shared,
                                                  what=f"a table that takes fault {fault}")
    verdict = ref.expand_verdict_reference(bad, num_tokens=t, routed_tokens=p, shared_tokens=s)
    assert verdict is not None and verdict[1] == row, verdict
    with pytest.raises(WireError) as host:
        wire.check_route_table(bad, num_tokens=t, routed_tokens=p, shared_tokens=s, top_k=top_k)
    device = wire.route_table_error(_record(verdict), shared_tokens=s)
    assert isinstance(device, WireError)
    named = re.match(r"route table row (\d+)", str(host.value))
    if named:  # the host names a row for the token, shared and packing rules
        assert int(named.group(1)) == row
        assert f"route table row {row}:" in str(device)
    else:
        assert "not a permutation" in str(host.value) and "not a permutation" in str(device)
    assert "attention rank 1 (ring 0)" in str(device) and "layer 5" in str(device)


def test_verdict_is_the_smallest_rule_then_row():
    rng = np.random.default_rng(3)
    table, t, p, s = _message(rng, num_tokens=30, num_ffn=1, top_k=4, epr=4, has_shared=1)
    bad = table.copy()
    kh.ROUTE_TABLE_FAULTS["duplicate_staging_row"](bad, num_tokens=t, shared_tokens=s, routed_tokens=p)
    bad[20, wire.ROUTE_SLOTS] = p  # a range fault at row 20: rule 4 beats the duplicate's 5
    bad[25, wire.ROUTE_TOKEN] = t  # a token fault at row 25 beats both
    bad[27, wire.ROUTE_TOKEN] = -4
    verdict = ref.expand_verdict_reference(bad, num_tokens=t, routed_tokens=p, shared_tokens=s)
    assert verdict == (wire.ROUTE_FAULT_TOKEN, 25, wire.ROUTE_TOKEN, t, t)
    bad[25, wire.ROUTE_TOKEN] = 0
    bad[27, wire.ROUTE_TOKEN] = 0
    assert ref.expand_verdict_reference(bad, num_tokens=t, routed_tokens=p, shared_tokens=s) == \
        (wire.ROUTE_FAULT_RANGE, 20, wire.ROUTE_SLOTS, p, p)


def test_duplicate_names_the_second_row_and_the_first_owner():
    rng = np.random.default_rng(4)
    table, t, p, s = _message(rng, num_tokens=30, num_ffn=1, top_k=2, epr=4, has_shared=0)
    bad = table.copy()
    taken = int(bad[3, wire.ROUTE_SLOTS])
    bad[9, wire.ROUTE_SLOTS] = taken
    bad[17, wire.ROUTE_SLOTS] = taken
    verdict = ref.expand_verdict_reference(bad, num_tokens=t, routed_tokens=p, shared_tokens=s)
    assert verdict == (wire.ROUTE_FAULT_DUPLICATE, 9, wire.ROUTE_SLOTS, 3, taken)
    message = str(wire.route_table_error(_record(verdict), shared_tokens=s))
    assert f"route table row 9: staging row {taken} (slot 0) is also named by row 3" in message


def test_count_rule_when_every_row_is_fine_but_a_staging_row_is_unnamed():
    rng = np.random.default_rng(5)
    table, t, p, s = _message(rng, num_tokens=30, num_ffn=1, top_k=4, epr=4, has_shared=1)
    bad = table.copy()
    assert kh.ROUTE_TABLE_FAULTS["staging_row_missing"](bad, num_tokens=t, shared_tokens=s,
                                                        routed_tokens=p) == -1
    verdict = ref.expand_verdict_reference(bad, num_tokens=t, routed_tokens=p, shared_tokens=s)
    assert verdict == (wire.ROUTE_FAULT_COUNT, -1, -1, p, p - 1)
    assert f"not a permutation of [0, {p})" in str(wire.route_table_error(_record(verdict),
                                                                           shared_tokens=s))
