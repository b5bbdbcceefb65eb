"""wire.reply_verdict: the status record the device's reply check latches, computed on the host
from the one Python rule set (wire.header_fault + wire.reply_fault) that decode_header and
check_reply raise from. The kernel tests compare it with what afd_wait_replies latches; here it
is held to the host checks on random corruptions, and to the device's kept-reply rule.
"""
import numpy as np
import pytest

from afd_cupy import errors, wire

EPR = 3


def _reply(want: wire.ReplyExpectation, *, wire_mode: str = "pair", num_tokens: int = 6,
           counts=(2, 0, 3)) -> np.ndarray:
    dispatch = wire.dispatch_header(seq=want.seq, src_rank=0, layer_idx=want.layer_idx,
                                    stage_idx=want.stage_idx, num_tokens=num_tokens,
                                    shared_tokens=want.shared_tokens, top_k=2, expert_counts=counts,
                                    wire_mode=wire_mode, num_rows=want.num_rows)
    return wire.encode_header(wire.reply_header(dispatch, seq=11, src_rank=want.peer), EPR)


def _host_error(words, wire_mode: str, want):
    try:
        wire.check_reply(wire.decode_header(words, EPR, wire_mode=wire_mode), want)
    except errors.AfdError as err:
        return err
    return None


PAIR_WANT = wire.ReplyExpectation(peer=2, seq=(1 << 32) + 5, layer_idx=4, stage_idx=1,
                                  routed_tokens=5, shared_tokens=2)
DEDUP_WANT = wire.ReplyExpectation(peer=2, seq=(1 << 32) + 5, layer_idx=4, stage_idx=1,
                                   routed_tokens=5, shared_tokens=2, num_rows=4)


@pytest.mark.parametrize("wire_mode,want", [("pair", PAIR_WANT), ("dedup", DEDUP_WANT)])
@pytest.mark.parametrize("seed", range(6))
def test_the_verdict_fails_exactly_when_the_host_checks_raise_and_names_the_same_error(
        seed, wire_mode, want):
    rng = np.random.default_rng(seed)
    clean = _reply(want, wire_mode=wire_mode)
    assert wire.reply_verdict(clean, want, wire_mode=wire_mode) == wire.CLEAR_STATUS
    num_failed = 0
    for _ in range(60):
        words = clean.copy()
        for word in rng.choice(words.size, size=rng.integers(1, 3), replace=False):
            words[word] = rng.choice([words[word] + rng.integers(-2, 3), rng.integers(-9, 9),
                                      wire.FLAG_SHUTDOWN | (words[wire.HDR_FLAGS] & wire.FLAG_DEDUP)])
        record = wire.reply_verdict(words, want, wire_mode=wire_mode, slot=7, ring=1, flag=99)
        host = _host_error(words, wire_mode, want)
        assert record.ok == (host is None), (words.tolist(), record, host)
        if host is None:
            continue
        num_failed += 1
        assert (record.peer, record.slot, record.ring, record.layer) == (want.peer, 7, 1, want.layer_idx)
        device = record.error(layer_idx=want.layer_idx, expert_per_rank=EPR)
        assert type(device) is type(host), (words.tolist(), record, host, device)
        if record.code == wire.STATUS_REPLY_MISMATCH:
            assert str(device) == str(host)
    assert num_failed > 10  # the corruptions did exercise the checks


def test_a_shutdown_that_kept_the_pending_reply_is_that_reply():
    words = _reply(PAIR_WANT)
    words[wire.HDR_FLAGS] |= wire.FLAG_SHUTDOWN | wire.FLAG_KEPT_REPLY
    assert wire.reply_verdict(words, PAIR_WANT, flag=wire.SHUTDOWN_SEQ) == wire.CLEAR_STATUS
    wire.check_reply(wire.decode_header(words, EPR), PAIR_WANT)  # the host delivers it too
    newer = wire.ReplyExpectation(**{**PAIR_WANT.__dict__, "seq": PAIR_WANT.seq + 1})
    record = wire.reply_verdict(words, newer, slot=3, ring=0, flag=wire.SHUTDOWN_SEQ)
    assert record == wire.StatusRecord(wire.STATUS_SHUTDOWN, newer.peer, 3, 0, newer.seq,
                                       wire.SHUTDOWN_SEQ, -1, -1, newer.layer_idx)
    with pytest.raises(errors.ConnectorShutdown, match="FFN rank 2 announced shutdown"):
        wire.check_reply(wire.decode_header(words, EPR), newer)


def test_header_faults_carry_the_receivers_expectation_where_the_header_has_none():
    words = _reply(DEDUP_WANT, wire_mode="dedup")
    words[wire.HDR_SHARED_TOKENS] = -1
    record = wire.reply_verdict(words, DEDUP_WANT, wire_mode="dedup")
    assert (record.code, record.count, record.expected, record.observed) == (
        wire.STATUS_BAD_HEADER, wire.HDR_SHARED_TOKENS, DEDUP_WANT.shared_tokens, -1)
    with pytest.raises(errors.WireError, match="negative sizes in header"):
        wire.decode_header(words, EPR, wire_mode="dedup")


def test_too_few_words_for_the_mode_are_refused():
    with pytest.raises(ValueError, match="too few"):
        wire.reply_verdict(np.zeros(wire.HDR_FIXED_WORDS - 1, np.int32), PAIR_WANT)
