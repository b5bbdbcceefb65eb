"""The protocol's home: header words and flags, encode/decode, reply and route-table checks,
status and doorbell words (docs/design/wire-format.md, docs/design/protocol.md). The window
geometry (capacities, slot layout, sizes) lives in :mod:`afd_cupy.wire.layout` and is part of this
package's API too. One module per responsibility, every public name importable from here:

- :mod:`~afd_cupy.wire.header`: header words and flags, :class:`Header`, encode/decode, the
  header's validity rule (:func:`header_fault`) and the message builders;
- :mod:`~afd_cupy.wire.reply`: what a reply must echo, late replies, :func:`reply_verdict`
  (the status record the device latches for a reply) and :func:`check_reply` (its error);
- :mod:`~afd_cupy.wire.checks`: a message's capacity before sending, the dedup route table;
- :mod:`~afd_cupy.wire.status`: status block and doorbell words, :class:`StatusRecord`.

``raw_kernels/common/wire.cuh`` mirrors the constants here and takes the offsets as kernel
arguments from :class:`WindowLayout`; ``tests`` check the mirror with a tiny kernel.

::

    window = [ flags: int64[num_regions * ring_depth], padded to 256 B | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | route_table | routed_x | shared_idx | shared_x ]   every field 256-B aligned

Two wire modes (``ConnectorConfig.wire_mode``, docs/design/dedup.md) share these field names:
``"pair"`` sends one row per (token, expert) partial plus a round-robin shared slice;
``"dedup"`` sends one row per (token, FFN rank it goes to) with a wider route table
(``route_table`` [token_cap, 2 + 2*top_k], ``routed_x`` [token_cap, hidden], empty shared
fields), marks its headers with ``FLAG_DEDUP`` and appends one header word, ``num_rows``.
``ConnectorConfig.dispatch_dtype="fp8_e4m3"`` (pair mode) sends E4M3 rows with 128-channel
scales (:mod:`afd_cupy.wire.fp8`), marked ``FLAG_FP8``; replies stay in the payload dtype.

Slot ``(region, ring)`` is slot number ``region * ring_depth + ring``; its flag is flag word
number ``region * ring_depth + ring``. A sender writes only ``region = its own role rank``.
"""
from __future__ import annotations

from afd_cupy.wire.checks import (ROUTE_FAULT_COUNT, ROUTE_FAULT_DUPLICATE, ROUTE_FAULT_PACKING,
                                  ROUTE_FAULT_RANGE, ROUTE_FAULT_SHARED, ROUTE_FAULT_TOKEN,
                                  check_capacity, check_route_table, route_table_error)
from afd_cupy.wire.fp8 import DISPATCH_DTYPES, FP8_GROUP, fp8_row_bytes
from afd_cupy.wire.header import (FLAG_DEDUP, FLAG_FP8, FLAG_KEPT_REPLY, FLAG_SHUTDOWN, HDR_ECHO_SEQ,
                                  HDR_FLAGS, HDR_LAYER, HDR_MAGIC, HDR_NUM_TOKENS,
                                  HDR_ROUTED_TOKENS, HDR_SEQ, HDR_SHARED_TOKENS, HDR_SRC_RANK,
                                  HDR_STAGE, HDR_TOPK, HDR_VERSION, HDR_WORD_NAMES, MAGIC,
                                  ROUTE_SHARED, ROUTE_SLOTS, ROUTE_TOKEN, SHUTDOWN_SEQ, VERSION,
                                  Header, check_dispatch_rows, decode_header, dispatch_header,
                                  dispatch_rows_fault, encode_header,
                                  header_fault, header_word_list, reply_header, shutdown_header,
                                  shutdown_over_reply, slot_moved_on)
from afd_cupy.wire.layout import (ALIGN, FIELD_NAMES, HDR_FIXED_WORDS, ROUTE_FIXED_WORDS,
                                  WIRE_MODES, WindowLayout, align_up, ffn_staging_size_hint,
                                  route_width, routed_capacity, shared_capacity, window_size_hint)
from afd_cupy.wire.reply import (ReplyExpectation, answers, check_reply, is_late_reply, reply_fault,
                                 reply_verdict)
from afd_cupy.wire.status import (CLEAR_STATUS, DB_FLAG, DB_HEADER, DB_SLOT, DB_STATUS, DB_TICKET,
                                  ST_CAP, ST_CODE, ST_COUNT, ST_EXPECTED, ST_LAYER, ST_OBSERVED,
                                  ST_PEER, ST_RING, ST_SLOT, STATUS_BAD_EXPERT, STATUS_BAD_HEADER,
                                  STATUS_CAPACITY, STATUS_FIELDS, STATUS_NAMES, STATUS_OK,
                                  STATUS_REPLY_MISMATCH, STATUS_SHUTDOWN, STATUS_TIMEOUT,
                                  STATUS_WORDS, StatusRecord)

__all__ = [
    # window geometry (afd_cupy.wire.layout)
    "ALIGN", "FIELD_NAMES", "HDR_FIXED_WORDS", "ROUTE_FIXED_WORDS", "WIRE_MODES", "WindowLayout",
    "align_up", "ffn_staging_size_hint", "route_width", "routed_capacity", "shared_capacity",
    "window_size_hint",
    # FP8 dispatch rows (afd_cupy.wire.fp8)
    "DISPATCH_DTYPES", "FP8_GROUP", "fp8_row_bytes",
    # header
    "FLAG_DEDUP", "FLAG_FP8", "FLAG_KEPT_REPLY", "FLAG_SHUTDOWN", "HDR_ECHO_SEQ", "HDR_FLAGS", "HDR_LAYER",
    "HDR_MAGIC", "HDR_NUM_TOKENS", "HDR_ROUTED_TOKENS", "HDR_SEQ", "HDR_SHARED_TOKENS",
    "HDR_SRC_RANK", "HDR_STAGE", "HDR_TOPK", "HDR_VERSION", "HDR_WORD_NAMES", "MAGIC",
    "ROUTE_SHARED", "ROUTE_SLOTS", "ROUTE_TOKEN", "SHUTDOWN_SEQ", "VERSION", "Header",
    "check_dispatch_rows", "decode_header", "dispatch_header", "dispatch_rows_fault", "encode_header", "header_fault", "header_word_list",
    "reply_header", "shutdown_header", "shutdown_over_reply", "slot_moved_on",
    # replies
    "ReplyExpectation", "answers", "check_reply", "is_late_reply", "reply_fault", "reply_verdict",
    # message contents
    "ROUTE_FAULT_COUNT", "ROUTE_FAULT_DUPLICATE", "ROUTE_FAULT_PACKING", "ROUTE_FAULT_RANGE",
    "ROUTE_FAULT_SHARED", "ROUTE_FAULT_TOKEN", "check_capacity", "check_route_table",
    "route_table_error",
    # status block and doorbell
    "CLEAR_STATUS", "DB_FLAG", "DB_HEADER", "DB_SLOT", "DB_STATUS", "DB_TICKET", "ST_CAP",
    "ST_CODE", "ST_COUNT", "ST_EXPECTED", "ST_LAYER", "ST_OBSERVED", "ST_PEER", "ST_RING",
    "ST_SLOT", "STATUS_BAD_EXPERT", "STATUS_BAD_HEADER", "STATUS_CAPACITY", "STATUS_FIELDS",
    "STATUS_NAMES", "STATUS_OK", "STATUS_REPLY_MISMATCH", "STATUS_SHUTDOWN", "STATUS_TIMEOUT",
    "STATUS_WORDS", "StatusRecord",
]
