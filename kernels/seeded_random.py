"""Triton kernel: uniform noise per request, reproducible from a seed.

Wrapper and reference: `vllm_specplug/verification/seeded_random.py`. Row b
draws `tl.rand` (Philox 4x32-10) with key `seed[b] + stream[b] * STREAM_STRIDE`
and counters 0..num_cols-1, so a request's noise depends only on its seed
and its stream (the position it verifies at): the same seed reproduces the
same output, as vLLM's own seeded sampling does.
"""
import triton
import triton.language as tl

STREAM_STRIDE = tl.constexpr(1000003)


@triton.jit
def seeded_uniform_kernel(seed_ptr, stream_ptr, out_ptr, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(seed_ptr + row) + tl.load(stream_ptr + row) * STREAM_STRIDE
    u = tl.rand(key, cols)
    tl.store(out_ptr + row * num_cols + cols, u, mask=cols < num_cols)
