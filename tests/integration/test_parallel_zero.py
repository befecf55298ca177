"""The sharded optimizer at 2 ranks (gloo, CPU) against one process's FlatAdamW: the weights
after several steps, with the gradient of one global batch split between the ranks, in both
gradient paths (overlapped buckets, step-time reduce-scatter); state resharded 2 -> 1 -> 2."""

from __future__ import annotations

import pytest
import torch
from support.parallel_util import ok, run_ranks
from support.zero_util import zero_batches, zero_model, zero_optim

STEPS = 4


def _train(model, opt, rank, size, steps=STEPS):
    infos = []
    for step in range(steps):
        seqs, n_tok = zero_batches(step)
        model.zero_grad()
        for s in seqs[rank::size]:
            cu = torch.tensor([0, len(s)], dtype=torch.int32)
            model.forward(s, cu)
            model.backward(torch.full((len(s),), -1.0 / n_tok))
        infos.append(opt.step(3e-2))
    return infos


def _ranks_fn(rank, out):
    """Every 2-rank scenario in one launch (spawning ranks costs seconds): both gradient paths
    in fp32 (their shards written), bf16 without a master, and a 1 -> 2 resume."""
    from rlcu.parallel.ckpt import load_optimizer
    from rlcu.parallel.zero import ShardedAdamW

    res = {}
    for overlap in (True, False):
        model = zero_model()
        opt = ShardedAdamW(model, zero_optim(), overlap=overlap)
        res[overlap] = (model.flat.clone(), _train(model, opt, rank, 2))
        res[overlap] = (model.flat.clone(), res[overlap][1])
        if overlap:
            (out / "optim").mkdir(exist_ok=True)
            torch.save(opt.state_dict(), out / "optim" / f"rank-{rank:05d}-of-00002.pt")
    kw = {"master_weights": False, "state_dtype": "bfloat16"}
    model = zero_model(torch.bfloat16)
    _train(model, ShardedAdamW(model, zero_optim(**kw)), rank, 2)
    res["bf16"] = model.flat.clone()
    # 1 -> 2: a one-process state after 2 steps (resume/), continued here
    model = zero_model()
    model.flat.copy_(torch.load(out / "resume" / "flat.pt"))
    opt = ShardedAdamW(model, zero_optim())
    load_optimizer(out / "resume", opt)
    assert opt.step_count == 2
    for step in range(2, STEPS):
        seqs, n_tok = zero_batches(step)
        model.zero_grad()
        for s in seqs[rank::2]:
            model.forward(s, torch.tensor([0, len(s)], dtype=torch.int32))
            model.backward(torch.full((len(s),), -1.0 / n_tok))
        opt.step(3e-2)
    res["resumed"] = model.flat.clone()
    res["batch"] = _batch_helpers(rank)
    return res


def _halves(rank):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, generator=g)
    x[3] = float("nan")
    return x, (x[:5] if rank == 0 else x[5:])


def _batch_helpers(rank):
    from rlcu.parallel import batch as dp
    from rlcu.train.losses import RunningMoments

    _, mine = _halves(rank)
    rm = RunningMoments()
    rm.update(torch.tensor([0.5, 1.5]))
    dp.update_moments(rm, mine)
    w = (~torch.isnan(mine)).float()
    return {"mean_std": dp.global_mean_std(mine), "moments": rm.state_dict(),
            "whiten": dp.global_whiten(torch.nan_to_num(mine), w), "block": dp.rank_block(7),
            "seqs": dp.rank_seq_range(12, 3), "gathered": dp.gather_samples([f"r{rank}a", f"r{rank}b"])}


def _one(dtype=torch.float32, cfgkw=None):
    from rlcu.optim import FlatAdamW

    model = zero_model(dtype)
    opt = FlatAdamW(model, zero_optim(**(cfgkw or {})))
    infos = _train(model, opt, 0, 1)
    return model, opt, infos


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_two_ranks_match_one_process(tmp_path):
    from rlcu.optim import FlatAdamW
    from rlcu.parallel.ckpt import load_optimizer

    m1 = zero_model()
    o1 = FlatAdamW(m1, zero_optim())
    _train(m1, o1, 0, 1, steps=2)
    (tmp_path / "resume").mkdir()
    torch.save(o1.state_dict(), tmp_path / "resume" / "optim.pt")
    torch.save(m1.flat, tmp_path / "resume" / "flat.pt")
    d, _ = run_ranks(_ranks_fn, 2, tmp_path, tmp_path)
    r0, r1 = ok(d)
    ref, opt, infos = _one()
    start = zero_model().flat
    assert _rel(ref.flat - start, start) > 1e-2  # the learning rate moves the weights visibly
    assert min(b["clip_scale"] for b in infos) < 1  # and clipping (0.5) is active
    for overlap in (True, False):
        (w0, i0), (w1, _) = r0[overlap], r1[overlap]
        assert torch.equal(w0, w1)  # every rank holds the same weights
        assert _rel(w0, ref.flat) < 1e-5, (overlap, _rel(w0, ref.flat))
        for a, b in zip(i0, infos):  # the global gradient norm, clipped as one process clips
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            assert a["clip_scale"] == pytest.approx(b["clip_scale"], rel=1e-5)
    # 2 -> 1: the shards written at 2 ranks load into one process's FlatAdamW
    m2 = zero_model()
    m2.flat.copy_(r0[True][0])
    o2 = FlatAdamW(m2, zero_optim())
    load_optimizer(tmp_path, o2)
    assert o2.step_count == STEPS
    assert _rel(o2.m, opt.m) < 1e-4 and _rel(o2.v, opt.v) < 1e-4
    # bf16 weights with no master and bf16 moments: a chunk draws the rounding bits of the same
    # elements in one process (index_base), so the ranks stay within reordered sums
    kw = {"master_weights": False, "state_dtype": "bfloat16"}
    ref16, _, _ = _one(torch.bfloat16, kw)
    assert torch.equal(r0["bf16"], r1["bf16"])
    assert _rel(r0["bf16"], ref16.flat) < 2e-3, _rel(r0["bf16"], ref16.flat)
    # 1 -> 2
    assert torch.equal(r0["resumed"], r1["resumed"])
    assert _rel(r0["resumed"], ref.flat) < 1e-5
    # the global-batch helpers: the statistics of the concatenated halves
    from rlcu.train.losses import RunningMoments, whiten

    x, _ = _halves(0)
    ok_ = x[~torch.isnan(x)]
    b0, b1 = r0["batch"], r1["batch"]
    for b in (b0, b1):
        assert b["mean_std"][0] == pytest.approx(float(ok_.double().mean()), rel=1e-12)
        assert b["mean_std"][1] == pytest.approx(float(ok_.double().std()), rel=1e-12)
    rm = RunningMoments()
    rm.update(torch.tensor([0.5, 1.5]))
    rm.update(x)
    for k, v in rm.state_dict().items():
        assert b0["moments"][k] == pytest.approx(v, rel=1e-12) and b1["moments"][k] == pytest.approx(v, rel=1e-12)
    w = (~torch.isnan(x)).float()
    want = whiten(torch.nan_to_num(x), w)
    assert torch.allclose(torch.cat([b0["whiten"], b1["whiten"]]), want, rtol=1e-5, atol=1e-6)
    assert (b0["block"], b1["block"]) == ((0, 3), (3, 7))
    assert (b0["seqs"], b1["seqs"]) == ((0, 6), (6, 12))
    assert b0["gathered"] == b1["gathered"] == ["r0a", "r0b", "r1a", "r1b"]
