"""ops/decode_linear.py: the fused decode projections (norm + GEMM, norm + gate_up + SwiGLU,
GEMM + residual) against their twin, the unfused ops, at odd shapes, with and without split-K;
on the CPU through TRITON_INTERPRET=1."""

import pytest
import torch

from rlcu.ops.decode_linear import decode_linear, decode_linear_ref, decode_linear_triton, heuristic_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _case(M, N, K, dtype, norm, swiglu, residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(2 * N if swiglu else N, K, generator=g) / K**0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype) if norm else None
    r = torch.randn(M, N, generator=g).to(dtype) if residual else None
    return x, w, nw, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["norm", "norm_swiglu", "residual", "plain"])
@pytest.mark.parametrize("split", [1, 3])
def test_matches_twin(dtype, kind, split):
    M, N, K = 17, 40, 160  # a row tile and a column tile past the end, a K tail (160 = 5 x 32)
    x, w, nw, r = _case(M, N, K, dtype, "norm" in kind, "swiglu" in kind, kind == "residual")
    ref = decode_linear_ref(x, w, nw, 1e-6, None if r is None else r.clone(), "swiglu" in kind)
    out = decode_linear_triton(x, w, nw, 1e-6, None if r is None else r.clone(), "swiglu" in kind,
                               (16, 16, 32, split, 4, 1))
    assert out.shape == ref.shape == (M, N)
    assert _rel(out, ref) < TOL[dtype], kind


def test_residual_in_place_and_one_row():
    x, w, _, r = _case(1, 24, 96, torch.float32, False, False, True, seed=1)
    want = r + x @ w.t()
    out = decode_linear_triton(x, w, None, 1e-6, r, False, (16, 16, 32, 2, 4, 1))
    assert out.data_ptr() == r.data_ptr()  # written where it was read
    assert _rel(r, want) < 1e-5


def test_split_is_deterministic_and_equals_unsplit_closely():
    x, w, nw, _ = _case(5, 32, 256, torch.float32, True, False, False, seed=2)
    a = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))
    b = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))
    c = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 1, 4, 1))
    assert torch.equal(a, b)
    assert _rel(a, c) < 1e-6


def test_dispatch_takes_the_twin_on_cpu_and_checks_shapes():
    x, w, nw, _ = _case(3, 8, 16, torch.float32, True, True, False)
    assert torch.equal(decode_linear(x, w, nw, 1e-6, None, True), decode_linear_ref(x, w, nw, 1e-6, None, True))
    with pytest.raises(ValueError, match="norm_w"):
        decode_linear(x, w, nw[:5])
    with pytest.raises(ValueError, match="swiglu"):
        decode_linear(x, w[:7], None, 1e-6, None, True)
    with pytest.raises(ValueError, match="residual"):
        decode_linear(x, w, None, 1e-6, torch.zeros(3, 9))


def test_heuristic_fills_the_gpu_with_programs():
    for M, N, K in [(1, 4096, 1024), (64, 1024, 2048), (256, 1024, 3072), (64, 151936, 1024), (256, 4096, 4096)]:
        BM, BN, BK, split, _, _ = heuristic_config(M, N, K)
        programs = -(-N // BN) * -(-M // BM) * split
        assert programs >= 64 or K // split < 4 * BK, (M, N, K, programs)
        assert K // split >= BK



_SIG = dict(X="*bf16", W="*bf16", G="*bf16", R="*bf16", Y="*bf16", P="*fp32", PSS="*fp32", M="i32", N="i32", K="i32",
            K_SPLIT="i32", stride_x="i32", stride_w="i32", stride_r="i32", stride_y="i32", eps="fp32")
_DIV16 = ["N", "K", "K_SPLIT", "stride_x", "stride_w", "stride_r", "stride_y"]
_VARIANTS = [  # (kind, (BM, BN, BK), partial, pdl)
    (dict(NORM=True, SWIGLU=False, RES=False), (16, 32, 128), False, False),
    (dict(NORM=True, SWIGLU=True, RES=False), (64, 64, 128), True, True),
    (dict(NORM=False, SWIGLU=False, RES=True), (64, 32, 128), False, True),
]


def test_compiles_for_hopper():
    # the GPU code the interpreter never sees: the weight loads pipelined (cp.async), warpgroup
    # MMAs at 64-row tiles, griddepcontrol and the L2 prefetch under PDL; and the reduce
    from hopper_compile import compile_sm90

    specs = [{"kernel": "rlcu.ops.decode_linear:_linear_kernel", "signature": _SIG, "div16": _DIV16,
              "constexprs": dict(kind, PARTIAL=partial, IEEE=False, PDL=pdl, PREFETCH=pdl, KL=16 if pdl else 1,
                                 LINE=64, BM=tile[0], BN=tile[1], BK=tile[2]),
              "options": dict(num_warps=4, num_stages=4, launch_pdl=pdl)} for kind, tile, partial, pdl in _VARIANTS]
    specs.append({"kernel": "rlcu.ops.decode_linear:_reduce_kernel",
                  "signature": dict(P="*fp32", PSS="*fp32", R="*bf16", Y="*bf16", M="i32", N="i32", K="i32",
                                    SPLIT="i32", stride_r="i32", stride_y="i32", eps="fp32"),
                  "constexprs": dict(NORM=True, SWIGLU=True, RES=False, BM=32, BN=128), "options": dict(num_warps=4)})
    got = compile_sm90(specs)
    for (kind, tile, _, pdl), k in zip(_VARIANTS, got):
        assert k["cp.async"], (kind, tile)
        assert k["wgmma"] == (tile[0] >= 64), (kind, tile)
        assert k["griddepcontrol"] == pdl and k["prefetch"] == pdl, (kind, tile)
        assert k["shared"] <= 227 * 1024
