"""The Attention role: its endpoint (protocol bookkeeping over its data path) and the decode
step captured in one CUDA graph with its plan (docs/design/architecture.md,
docs/design/cuda-graphs.md). The kernels it launches live in ``raw_kernels/attention/``.
"""
