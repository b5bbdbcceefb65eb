// ffn_graph.cuh: the device steps of the graph-driven FFN (docs/design/cuda-graphs.md). One CUDA graph
// per size bucket replays, with no host step per item:
//
//   afd_graph_wait_stage -> afd_graph_gather<DT>
//   -> grouped GEMMs over the stacked layers (torch) -> afd_graph_reply<DT>
//
// and in the dedup wire mode (docs/design/dedup.md):
//
//   afd_graph_wait_stage -> afd_graph_dedup_expand<DT> -> grouped GEMMs
//   -> afd_graph_dedup_reply<DT>
//
// afd_graph_wait_stage is afd_wait_any (its flag scan, wait_any.cuh) and afd_graph_stage in one
// kernel; the two-kernel form (afd_wait_any into a DEVICE doorbell, then afd_graph_stage) stays
// for comparison (GraphFFNServer(fused_wait_stage=False)) and for the stage's own tests.
//
// Nothing the graph needs is frozen at capture except buffers: the stage reads which slot
// arrived, its header and counts from what the wait found (shared memory in the fused kernel,
// the device doorbell in the two-kernel form),
// checks the header as wire.decode_header does, decides what this replay does (GS_*), writes
// the grouped-GEMM group offsets of the stacked-layer problem list (zero-size groups for every
// layer but the arrived one, all zero when nothing is served), reserves the reply seq of the
// slot, builds the reply header as wire.reply_header does, and writes one record per replay
// into a ring in pinned host memory (the host reads it after the replay's event completed).
// The gather copies the arrived rows into the fixed staging rows the GEMMs read; the reply
// copies the output rows into the sender's window, then header, system fence, flag = seq.
// Dedup: the expand copies and checks the route table (dedup_ffn.cuh, as afd_dedup_expand) and
// scatters the rows into the grouped staging; a rejected table turns the replay's record into
// GS_BAD_ROUTE with the verdict, gives the reserved reply seq back and stops the reply. The
// dedup reply reduces the grouped outputs to one row per received row (fused, as
// afd_dedup_reply) before header, fence and flag.
// References: afd_cupy/ffn/graph.py (stage_reference, dedup_expand_reference,
// dedup_reply_reference; gather/reply in the cuda tests).
//
// The kernels: afd_graph_stage and afd_graph_wait_stage in ffn_graph_stage.cu; afd_graph_gather,
// afd_graph_reply, afd_graph_dedup_expand and afd_graph_dedup_reply in ffn_graph_rows.cu. This
// header holds the words they share (afd_cupy/ffn/graph.py mirrors them; a CPU test parses them).
#pragma once

namespace afd {

// What one replay did (REC_STATUS; afd_cupy/ffn/graph.py GS_*).
constexpr int GS_IDLE = 0;      // wait_any timed out: nothing consumed
constexpr int GS_SERVED = 1;    // computed and answered inside the graph
constexpr int GS_SHUTDOWN = 2;  // a shutdown message was consumed (src rank in the header copy)
constexpr int GS_EAGER = 3;     // a valid item the graph does not serve (larger than the bucket,
                                // layer outside the stacked weights): the host serves it on the
                                // eager path with the reply seq reserved in REC_SEQ
constexpr int GS_REJECTED = 4;  // the header fails a check: the host decodes it and raises
constexpr int GS_BAD_ROUTE = 5;  // dedup: the route table fails a check (afd_graph_dedup_expand):
                                 // the verdict follows the record's header words, the reserved
                                 // reply seq is given back, nothing is answered

// Device state of the current replay, written by the stage, read by gather and reply
// (int64 words; the reply header follows as int32 words from int64 word STATE_HEADER).
constexpr int STATE_ACTIVE = 0;  // 1: gather and reply run
constexpr int STATE_SLOT = 1;
constexpr int STATE_REGION = 2;
constexpr int STATE_RING = 3;
constexpr int STATE_ROUTED = 4;
constexpr int STATE_SHARED = 5;
constexpr int STATE_SEQ = 6;
constexpr int STATE_CHUNK = 7;  // layer chunk holding the arrived layer (its GEMM output is read)
constexpr int STATE_RECORD = 8;  // address of this replay's record (pinned host memory)
constexpr int STATE_HEADER = 9;

// One record per replay in a pinned host ring (int64 words; header as int32 from REC_HEADER).
constexpr int REC_REPLAY = 0;  // replay number (device counter), written last
constexpr int REC_STATUS = 1;  // GS_*
constexpr int REC_SLOT = 2;    // slot consumed, -1 when idle
constexpr int REC_FLAG = 3;    // its flag value
constexpr int REC_SEQ = 4;     // reply seq used (SERVED) or reserved for the host (EAGER), else 0
constexpr int REC_DETAIL = 5;  // REJECTED: header word that failed (wire.HDR_*), else -1
constexpr int REC_HEADER = 6;  // the dispatch header words as consumed; dedup: the route-table
                               // verdict (STATUS_WORDS, as a status block) after them, at int64
                               // word REC_HEADER + ceil(header_words / 2), when GS_BAD_ROUTE

}  // namespace afd
