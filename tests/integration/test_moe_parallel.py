"""A Qwen3-MoE policy at 2 ranks (gloo, CPU) equals one process (issue 37): every rank holds every
expert (the flat weights whole, the routers and experts in their layers' slots), the optimizer
state in 1/N shards as for a dense model, the gradient reduced as one; the routing metric
(moe/route_mismatch*) summed over the ranks' rows.

The load-balancing loss is a micro-batch's (as transformers takes it over one forward's rows), so
its gradient depends on which sequences share a micro-batch: N ranks equal one process where the
micro-batches hold the same sequences (here one each); without it, at any packing."""

from __future__ import annotations

import pytest
import torch
from support.parallel_util import ok, run_ranks
from support.trainers import TINY, first_is_even, grpo_config

import rlcu
from rlcu.parallel.batch import dummy_backward

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 5 experts top 2 (renormalised), layer 1 dense
MOE = dict(TINY, num_hidden_layers=2, family="qwen3_moe", num_experts=5, num_experts_per_tok=2,
           moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.01)
CASES = {"aux": dict(output_router_logits=True, micro_batch_tokens=8),  # a sequence a micro-batch
         "packed": dict(output_router_logits=False, micro_batch_tokens=24)}
METRICS = ("moe/route_mismatch", "moe/route_mismatch_any", "moe/route_mismatch_layer_max")


def _grpo(out, case):
    from rlcu.data import synthetic as syn
    from rlcu.train.grpo import GRPOTrainer

    c = CASES[case]
    cfg, tok = grpo_config(out, steps=3, kl_coef=0.05, micro_batch_tokens=c["micro_batch_tokens"],
                           optim=dict(lr=3e-2))
    cfg.model.tiny = dict(MOE, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                          output_router_logits=c["output_router_logits"])
    tr = GRPOTrainer(cfg, syn.sort_rows(64, "train", min_len=2, max_len=3), [first_is_even], tokenizer=tok)
    return tr, tr.train()


def _ranks(rank, tmp):
    out = {}
    for case in CASES:
        g, hist = _grpo(tmp / f"{case}2", case)
        out[case] = {"flat": g.model.flat.clone(), "hist": hist, "opt": type(g.opt).__name__}
    return out


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_moe_grpo_two_ranks_equal_one_process(tmp_path):
    d, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(d)
    for case in CASES:
        a = r0[case]
        assert a["opt"] == "ShardedAdamW" and torch.equal(a["flat"], r1[case]["flat"])  # every expert on every rank
        g, hist = _grpo(tmp_path / f"{case}1", case)
        assert (g.model.cfg.aux_coef > 0) == CASES[case]["output_router_logits"]
        init = rlcu.CausalLM.from_config(g.model.cfg, seed=3)  # model.init_seed
        for k in ("layers.0.router", "layers.0.experts_gate_up"):  # trained
            assert _rel(g.model.w[k], init.w[k]) > 1e-3, k
        # the aux loss's share (its micro-batch's tokens over the batch's) leaves some attention
        # gradients near Adam's eps, whose update then magnifies the ranks' order of sums (9e-5)
        tol = 2e-4 if CASES[case]["output_router_logits"] else 1e-5
        assert _rel(a["flat"], g.model.flat) < tol, (case, _rel(a["flat"], g.model.flat))
        for x, y in zip(a["hist"], hist):  # the same samples, rewards and global statistics
            assert x["reward"] == y["reward"] and x["completion_len"] == y["completion_len"]
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
            assert all(x[k] == y[k] for k in METRICS), (case, [(x[k], y[k]) for k in METRICS])


def test_a_dummy_backward_adds_no_load_balancing_gradient():
    """A rank short of micro-batches runs dummy backwards: its MoE layers' load-balancing loss
    (which does not depend on the head's zero gradient) is weighted 0 there, and the model's
    own weight kept."""
    cfg = rlcu.CausalLMConfig(**dict(MOE, vocab_size=50, output_router_logits=True))
    m = rlcu.CausalLM.from_config(cfg, seed=1)
    m.zero_grad()
    dummy_backward(m)
    assert m.aux_loss is not None and m.aux_weight is None
    assert torch.count_nonzero(m.grad_flat) == 0
