"""ops/decode_linear.py: the fused decode projections (norm + GEMM, norm + gate_up + SwiGLU,
GEMM + residual) against their twin, the unfused ops, at odd shapes, with and without split-K;
on the CPU through TRITON_INTERPRET=1."""

import pytest
import torch

from rlcu.ops import decode_linear as dl
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
@pytest.mark.parametrize("split", [1, "3_inline", "3_kernel"])
def test_matches_twin(dtype, kind, split, monkeypatch):
    """split 3: the partials added by each tile's last program (inline) or by the reduce kernel."""
    if split != 1:
        monkeypatch.setitem(dl.CONFIGS, "inline_reduce", split.endswith("inline"))
        split = 3
    M, N, K = 17, 40, 160  # a row tile and a column tile past the end, a K tail (160 = 5 x 32)
    x, w, nw, r = _case(M, N, K, dtype, "norm" in kind, "swiglu" in kind, kind == "residual")
    ref = decode_linear_ref(x, w, nw, 1e-6, None if r is None else r.clone(), "swiglu" in kind)
    out = decode_linear_triton(x, w, nw, 1e-6, None if r is None else r.clone(), "swiglu" in kind,
                               (16, 16, 32, split, 4, 1))
    assert out.shape == ref.shape == (M, N)
    assert _rel(out, ref) < TOL[dtype], kind
    assert not dl._COUNTERS or all(c.eq(0).all() for c in dl._COUNTERS.values())  # zero for the next launch


def test_residual_in_place_and_one_row():
    x, w, _, r = _case(1, 24, 96, torch.float32, False, False, True, seed=1)
    want = r + x @ w.t()
    out = decode_linear_triton(x, w, None, 1e-6, r, False, (16, 16, 32, 2, 4, 1))
    assert out.data_ptr() == r.data_ptr()  # written where it was read
    assert _rel(r, want) < 1e-5


def test_split_is_deterministic_and_equals_unsplit_closely(monkeypatch):
    """Both reduces add the partials in split order: the same bits, run after run and one
    against the other."""
    x, w, nw, _ = _case(5, 32, 256, torch.float32, True, False, False, seed=2)
    a = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))
    b = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))
    c = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 1, 4, 1))
    monkeypatch.setitem(dl.CONFIGS, "inline_reduce", False)
    d = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))
    assert torch.equal(a, b) and torch.equal(a, d)
    assert _rel(a, c) < 1e-6


def test_inline_reduce_falls_back_to_the_kernel(monkeypatch):
    """More tiles than the counters hold: the reduce kernel serves the call."""
    launched = []
    monkeypatch.setattr(dl, "_MAX_TILES", 2)
    reduce = dl._reduce_kernel
    monkeypatch.setattr(dl, "_reduce_kernel", type("K", (), {"__getitem__": lambda s, g: (
        lambda *a, **k: launched.append(g) or reduce[g](*a, **k))})())
    x, w, nw, _ = _case(5, 48, 256, torch.float32, True, False, False, seed=3)
    out = decode_linear_triton(x, w, nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))  # 3 column tiles
    assert launched and _rel(out, decode_linear_ref(x, w, nw, 1e-6)) < 1e-5
    launched.clear()
    decode_linear_triton(x, w[:32], nw, 1e-6, None, False, (16, 16, 32, 4, 4, 1))  # 2 tiles: inline
    assert not launched


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




def test_table_entry_none_runs_the_unfused_ops(monkeypatch):
    # bench/decode_linear.py writes None where cuBLAS and the unfused kernels beat every tile
    from rlcu.ops import decode_linear as dl

    x, w, nw, _ = _case(5, 24, 64, torch.float32, True, False, False, seed=3)
    monkeypatch.setattr(dl, "interpreting", lambda: False)  # config_for reads the table
    monkeypatch.setitem(dl.CONFIGS, "table", {(24, 64, False): [(8, None)]})
    assert dl.config_for(5, 24, 64, False) is None
    assert torch.equal(decode_linear_triton(x, w, nw, 1e-6), decode_linear_ref(x, w, nw, 1e-6))


def test_bench_sweep_takes_wide_row_tiles_where_the_rows_fill_them():
    pytest.importorskip("triton")
    from bench.decode_linear import WIDE_ROWS, candidates

    assert max(c[0] for c in candidates(64, 1024, 2048)) == 64  # row_tile's 64 at most
    wide = {M: {c[:2] for c in candidates(M, 1024, 2048) if c[0] > 64} for M in (128, 256)}
    assert wide[128] == {t for t in WIDE_ROWS if t[0] == 128}
    assert wide[256] == set(WIDE_ROWS)
    assert all((c[2], c[4], c[5]) == (64, 8, 3) for c in candidates(256, 1024, 2048) if c[0] > 64)  # BK, warps, stages


def test_bench_heuristic_entry_is_a_tile_where_the_table_says_unfused(monkeypatch):
    # bench/decode_linear.py timed its `heuristic` entry at config_for's tiles, which are None
    # where the table sends the op to the unfused ops: the sweep then crashed unpacking None
    pytest.importorskip("triton")
    from bench.decode_linear import own_config
    from rlcu.ops import decode_linear as dl
    from rlcu.ops import decode_qkv as dq

    monkeypatch.setattr(dl, "interpreting", lambda: False)  # table_config reads the table
    monkeypatch.setitem(dl.CONFIGS, "table", {(1024, 2048, False): [(1 << 30, None)],
                                             (3072, 1024, True): [(1 << 30, None)],
                                             (4096, 1024, dq.KIND): [(1 << 30, None)]})
    assert own_config("o", 256, 1024, 2048) == dl.heuristic_config(256, 1024, 2048)
    assert own_config("gate_up", 256, 6144, 1024) == dl.heuristic_config(256, 3072, 1024)
    assert own_config("qkv", 256, 4096, 1024, 128) == dq.heads_config(256, 32, 1024)
    monkeypatch.setitem(dl.CONFIGS, "table", {(1024, 2048, False): [(1 << 30, (64, 32, 128, 2, 4, 6))]})
    assert own_config("o", 256, 1024, 2048) == (64, 32, 128, 2, 4, 6)  # a tabled tile is kept
