"""Chain and tree verification and KV compaction: Triton wrappers and their
PyTorch references (kernels in `kernels/`)."""
