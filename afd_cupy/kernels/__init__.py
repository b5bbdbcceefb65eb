"""The CuPy RawKernels of ``raw_kernels/<role>/*.cu``: loader, checked launches, status
(docs/design/kernels.md).

- :mod:`~afd_cupy.kernels.loader`: one cached loader. :func:`load_module` compiles a ``.cu``
  file once per (file, options, name expressions, device) with NVRTC (``-std=c++17
  -I raw_kernels``, no jitify); the cache key covers the contents of the file and of every
  header it includes, and the same digest is passed as ``-DAFD_SOURCE_KEY=...`` so that CuPy's
  on-disk cache is invalidated by a header edit too. ``AFD_KERNEL_CACHE=0`` disables the
  in-process cache. Probes (``raw_kernels/probes/``) have their own registry. The sources
  (``KERNEL_DIR``) are the installed package's ``afd_cupy/raw_kernels/`` (a wheel), else the
  checkout's top-level ``raw_kernels/``.
- :mod:`~afd_cupy.kernels.specs`: one spec builder per kernel (a module per kernel file),
  keyword names equal to the C parameter names, their arguments checked by
  :mod:`~afd_cupy.kernels.checks`; window geometry as one ``geo`` value (``WindowLayout.kernel_geometry()``,
  ``struct SlotGeometry`` in ``common/wire.cuh``); the kernels' limits (:data:`KERNEL_LIMITS`).
- :mod:`~afd_cupy.kernels.launches`: :class:`LaunchSpec` and :class:`PackedLaunch` (one
  ``cuLaunchKernel`` per launch, arguments rewritten in place). None of the launches
  synchronizes.
- :mod:`~afd_cupy.kernels.status`: :class:`PinnedInt64`, the device :class:`StatusBlock` and the
  :class:`StatusChannel` that raises what the kernels latched. The status and doorbell words
  themselves are protocol: :mod:`afd_cupy.wire`.

Importing this package does not import CuPy.
"""
from afd_cupy.kernels.launches import LaunchSpec, PackedLaunch
from afd_cupy.kernels.loader import (DTYPE_CODES, FILE_KERNELS, KERNEL_DIR, PROBE_KERNELS,
                                     clear_cache, get_kernel, kernel_name_expressions, load_module,
                                     source_key)
from afd_cupy.kernels.specs import (CHUNK, KERNEL_LIMITS, MAX_BLOCKS, MAX_EXPERTS, MAX_FFN_RANKS,
                                    MAX_TOP_K, ROWS_PER_BLOCK, COMBINE_SELF_WAIT_BLOCKS, combine_grid,
                                    combine_parts, combine_spec, combine_waits_itself,
                                    dedup_combine_spec, dedup_dispatch_fused_spec,
                                    dedup_dispatch_ll_spec, dedup_ll_grid, ll_dedup_dispatch_fits,
                                    dedup_expand_grid, dedup_expand_spec, dedup_reply_grid,
                                    dedup_reply_spec, dedup_rows_grid, dedup_rows_spec,
                                    dedup_scatter_grid, dedup_scatter_spec, dispatch_fused_spec,
                                    dispatch_num_chunks, dispatch_plan_spec, dispatch_row_bytes,
                                    dispatch_scatter_spec, fp8_dequant_rows_spec,
                                    fused_dedup_dispatch_fits, fused_dispatch_fits, plan_grid,
                                    own_routing_grid, own_routing_spec, reply_grid, reply_spec, row_parts,
                                    scatter_grid, wait_any_spec,
                                    wait_pass_mark, wait_replies_spec)
from afd_cupy.kernels.status import PinnedInt64, StatusBlock, StatusChannel

__all__ = [
    "CHUNK", "DTYPE_CODES", "FILE_KERNELS", "KERNEL_DIR", "KERNEL_LIMITS", "LaunchSpec",
    "MAX_BLOCKS", "MAX_EXPERTS", "MAX_FFN_RANKS", "MAX_TOP_K", "PROBE_KERNELS", "PackedLaunch",
    "PinnedInt64", "ROWS_PER_BLOCK", "StatusBlock", "StatusChannel", "clear_cache",
    "COMBINE_SELF_WAIT_BLOCKS", "combine_grid", "combine_parts", "combine_spec", "combine_waits_itself", "dedup_combine_spec", "dedup_dispatch_fused_spec",
    "dedup_dispatch_ll_spec", "dedup_ll_grid", "ll_dedup_dispatch_fits",
    "dedup_expand_grid",
    "dedup_expand_spec", "dedup_reply_grid", "dedup_reply_spec", "dedup_rows_grid",
    "dedup_rows_spec", "dedup_scatter_grid", "dedup_scatter_spec", "dispatch_num_chunks",
    "dispatch_fused_spec", "dispatch_plan_spec", "dispatch_row_bytes", "fp8_dequant_rows_spec",
    "dispatch_scatter_spec", "fused_dedup_dispatch_fits", "fused_dispatch_fits", "get_kernel", "kernel_name_expressions", "load_module", "plan_grid",
    "own_routing_grid", "own_routing_spec", "reply_grid", "reply_spec", "row_parts", "scatter_grid", "source_key", "wait_any_spec",
    "wait_pass_mark", "wait_replies_spec",
]
