"""Data paths: how the bytes of a message reach a peer's window and how arrivals are found.

``base`` defines the seam (:class:`~afd_cupy.backends.base.DataPath`); ``host`` is the numpy
reference twin of the kernels; ``cuda`` drives the RawKernels over NVSHMEM windows.
"""
