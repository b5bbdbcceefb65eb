"""One spec builder and one grid function per kernel of ``raw_kernels/``, a module per kernel file.

Every builder takes keyword arguments named exactly like the kernel's C parameters (plus
``dtype_code`` for the payload templates and ``max_blocks``), checks them cheaply (dtype and
size of the arrays, signs of the sizes, the limits; :mod:`afd_cupy.kernels.checks`), raises
``ValueError`` naming the argument and returns a :class:`~afd_cupy.kernels.launches.LaunchSpec`.
Raw addresses (windows, peer mappings, pinned host memory) are ``int``; scratch buffers are
CuPy arrays; ``geo`` is ``WindowLayout.kernel_geometry()``. Kernels that use a
``done_counter`` (uint32 [1], zero, device) leave it at zero again; one counter per kernel in
flight.

- :mod:`.limits`: :data:`KERNEL_LIMITS` (the constants of ``common/wire.cuh``) and the row
  geometry; :mod:`.groups`: argument groups the pair and dedup kernels share.
- :mod:`.dispatch` (``attention/dispatch.cu``), :mod:`.combine` (``attention/combine.cu``),
  :mod:`.dedup_attn` (``attention/dedup_attn.cu``, ``attention/dedup_attn_fused.cu``),
  :mod:`.dedup_attn_ll` (``attention/dedup_attn_ll.cu``): the Attention side; :mod:`.gate`
  (``model/gate.cu``): the model's gate.
- :mod:`.ffn` (``ffn/wait_any.cu``, ``ffn/reply.cu``, ``ffn/dedup_ffn.cu``), :mod:`.graph`
  (``ffn/ffn_graph_stage.cu``, ``ffn/ffn_graph_rows.cu``): the FFN side.

Every public name of those modules is importable from here (``afd_cupy.kernels.specs.X``).
"""
from afd_cupy.kernels.launches import LaunchSpec  # noqa: F401 - the builders' return type
from afd_cupy.kernels.specs.limits import (CHUNK, COMBINE_PART_BLOCKS, KERNEL_LIMITS, MAX_BLOCKS, MAX_EXPERTS,
                                           MAX_FFN_RANKS, MAX_TOP_K, ROWS_PER_BLOCK, ROW_MAX_PARTS,
                                           ROW_PART_BYTES, ROW_PART_WARPS, few_row_parts,
                                           payload_row_bytes, row_grid, row_parts)
from afd_cupy.kernels.specs.dispatch import (FUSED_MAX_SHARED_BYTES, dispatch_fused_spec,
                                             dispatch_num_chunks, dispatch_plan_spec,
                                             dispatch_row_bytes,
                                             dispatch_scatter_spec, fused_dispatch_fits,
                                             own_routing_grid, own_routing_reference, own_routing_spec,
                                             fused_shared_bytes, plan_grid, scatter_grid)
from afd_cupy.kernels.specs.combine import (COMBINE_SELF_WAIT_BLOCKS, combine_grid, combine_parts,
                                            combine_spec, combine_waits_itself, wait_pass_mark,
                                            wait_replies_spec)
from afd_cupy.kernels.specs.ffn import (dedup_expand_grid, dedup_expand_spec, dedup_reply_grid,
                                        dedup_reply_spec, fp8_dequant_rows_spec, reply_grid,
                                        reply_spec, wait_any_spec)
from afd_cupy.kernels.specs.dedup_attn import (DEDUP_FUSED_MAX_SHARED_BYTES, dedup_combine_spec,
                                               dedup_dispatch_fused_spec, dedup_fused_shared_bytes,
                                               dedup_rows_grid, dedup_rows_spec, dedup_scatter_grid,
                                               dedup_scatter_spec, fused_dedup_dispatch_fits)
from afd_cupy.kernels.specs.dedup_attn_ll import (DEDUP_LL_MAX_SHARED_BYTES, LL_MAX_FFN_RANKS,
                                                  dedup_dispatch_ll_spec, dedup_ll_grid,
                                                  dedup_ll_shared_bytes, ll_dedup_dispatch_fits)
from afd_cupy.kernels.specs.graph import (GRAPH_MAX_GROUPS, STAGE_RECORD_HEADER, STAGE_STATE_HEADER,
                                          graph_dedup_expand_spec, graph_dedup_reply_spec,
                                          graph_gather_spec, graph_reply_spec, graph_stage_spec,
                                          graph_wait_stage_spec)
from afd_cupy.kernels.specs.gate import GATE_LIMITS, GATE_SCORING, gate_grid, gate_topk_spec

__all__ = [
    "CHUNK", "DEDUP_FUSED_MAX_SHARED_BYTES", "DEDUP_LL_MAX_SHARED_BYTES", "FUSED_MAX_SHARED_BYTES",
    "GATE_LIMITS", "GATE_SCORING", "GRAPH_MAX_GROUPS", "KERNEL_LIMITS", "LL_MAX_FFN_RANKS",
    "MAX_BLOCKS", "MAX_EXPERTS",
    "MAX_FFN_RANKS", "MAX_TOP_K", "ROWS_PER_BLOCK", "ROW_MAX_PARTS", "ROW_PART_BYTES",
    "STAGE_RECORD_HEADER", "STAGE_STATE_HEADER", "COMBINE_PART_BLOCKS", "COMBINE_SELF_WAIT_BLOCKS", "combine_grid", "combine_parts", "combine_spec", "combine_waits_itself",
    "dedup_combine_spec", "dedup_dispatch_fused_spec", "dedup_dispatch_ll_spec", "dedup_expand_grid", "dedup_expand_spec",
    "dedup_fused_shared_bytes", "dedup_ll_grid", "dedup_ll_shared_bytes", "dedup_reply_grid", "dedup_reply_spec", "dedup_rows_grid",
    "dedup_rows_spec", "dedup_scatter_grid", "dedup_scatter_spec", "dispatch_fused_spec",
    "dispatch_num_chunks", "dispatch_plan_spec", "dispatch_scatter_spec",
    "fused_dedup_dispatch_fits", "fused_dispatch_fits", "fused_shared_bytes", "gate_grid",
    "gate_topk_spec", "graph_dedup_expand_spec", "graph_dedup_reply_spec", "graph_gather_spec",
    "graph_reply_spec", "graph_stage_spec", "graph_wait_stage_spec", "ll_dedup_dispatch_fits",
    "payload_row_bytes",
    "dispatch_row_bytes", "few_row_parts", "fp8_dequant_rows_spec", "own_routing_grid", "own_routing_reference", "own_routing_spec", "plan_grid", "reply_grid", "reply_spec", "row_grid", "row_parts", "scatter_grid",
    "wait_any_spec", "wait_pass_mark", "wait_replies_spec",
]
