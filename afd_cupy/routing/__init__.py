"""Host-side routing plans in numba, with their numpy references: which partial goes to which
FFN rank and slot row (pair mode) and the dedup wire mode's steps (docs/design/dedup.md). The
host backend runs them; the cuda backend's kernels compute the same plans on the device.
"""
