"""The FFN role: its endpoint, the self-driven :class:`~afd_cupy.ffn.worker.FFNWorker` and what
it serves with (weights, the lockstep buffer and batch, the overlap of replies, the graph FFN's
protocol words, the choice of serving), plus its opt-in recorder (docs/design/protocol.md, FFN
side; docs/design/cuda-graphs.md). The kernels it launches live in ``raw_kernels/ffn/``.
"""
