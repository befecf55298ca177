"""bench/stream_gemm.py's probe kernels compute x W^T, and the fused ones rmsnorm(x) W^T and its
SwiGLU (on the CPU through Triton's interpreter, in fp32: the interpreter's bf16 dot is not the
GPU's), at row counts that fill one row tile, part of one and two; and every candidate tile it
times fits the SM's shared memory."""

import pytest
import torch
from support.interp_util import needs_triton

stream = pytest.importorskip("bench.stream_gemm")


@needs_triton(stream._stream_kernel)
@pytest.mark.parametrize("M", [1, 20, 130])
def test_stream_gemm_is_x_wt(M):
    g = torch.Generator().manual_seed(M)
    N, K = 64, 256
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    y = torch.full((M, N), float("nan"))
    for cfg in [(16, 128, 3, 4), (32, 256, 2, 4)]:
        stream.stream_gemm(x, w, y, cfg)
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-4)


def test_candidates_tile_and_fit():
    for M in (1, 64, 128, 256):
        for N, K in ((4096, 1024), (1024, 3072), (24576, 4096)):
            cs = stream.candidates(N, K, M, quick=False)
            assert cs, (M, N, K)
            BM = stream.row_tile(M)
            for bn, bk, stages, _warps in cs:
                assert N % bn == 0 and K % bk == 0
                assert stages * (BM + bn) * bk * 2 <= stream.SMEM
    assert stream.row_tile(1) == 16 and stream.row_tile(64) == 64 and stream.row_tile(256) == 128


@needs_triton(stream._stream_fused_kernel)
@pytest.mark.parametrize("x_next", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_stream_fused_is_norm_then_projection(swiglu, x_next):
    g = torch.Generator().manual_seed(int(swiglu))
    M, N, K, eps = 20, 32, 256, 1e-6
    x, gain = torch.randn(M, K, generator=g), 1 + 0.1 * torch.randn(K, generator=g)
    w = torch.randn(2 * N if swiglu else N, K, generator=g)
    h = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * gain
    want = h @ w.t()
    if swiglu:
        want = torch.nn.functional.silu(want[:, :N]) * want[:, N:]
    y = torch.full((M, N), float("nan"))
    stream.stream_fused(x, gain, w, y, (16, 128, 2, 4), eps, swiglu, x_next)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
