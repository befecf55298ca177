"""A Qwen3-MoE policy's routing in RL (train/moe_routes.py): every step logs how often the
trainer's top-k experts differ from the rollout engine's; routing replay makes the trainer take
the engine's; exact mode disagrees nowhere; the metric and replay both see a planted disagreement."""

import pytest
import torch
from support.trainers import TINY, first_is_seven, grpo_trainer

import rlcu
from rlcu.data import synthetic as syn
from rlcu.engine import routes as engine_routes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _moe_folder(tmp_path):
    tok = syn.make_tokenizer()
    shape = dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id, num_hidden_layers=3)
    cfg = rlcu.CausalLMConfig(**shape, family="qwen3_moe", num_experts=5, num_experts_per_tok=2,
                              moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=(1,))
    folder = tmp_path / "moe"
    rlcu.CausalLM.from_config(cfg, seed=3, init_std=0.2).save_pretrained(folder)
    return folder


def _run(tmp_path, folder, steps=2, **kw):
    tr = grpo_trainer(tmp_path, rewards=[first_is_seven], steps=steps, prompts_per_step=4, group_size=4,
                      max_new_tokens=3, optim=dict(lr=1e-2), model=dict(tiny=None, path=str(folder)), **kw)
    return tr, tr.train()


@pytest.mark.parametrize("routing", ["default", "replay"])
def test_exact_mode_disagrees_nowhere(tmp_path, routing):
    folder = _moe_folder(tmp_path)
    _, hist = _run(tmp_path, folder, exact=True, moe=dict(routing=routing))
    for h in hist:
        assert h["moe/route_mismatch"] == 0 and h["moe/route_mismatch_any"] == 0
        assert h["mismatch/exact_frac"] == 1.0  # and every logprob bit-equal


def _planted(monkeypatch):
    """The engine's routes of the first sparse layer moved to other experts (each id + 1 mod E)."""
    gather = engine_routes.RouteLog.gather

    def planted(self, slots):
        r = gather(self, slots).clone()
        r[:, 0] = (r[:, 0].long() + 1) % 5
        return r

    monkeypatch.setattr(engine_routes.RouteLog, "gather", planted)


def test_planted_disagreement_is_measured_and_replayed(tmp_path, monkeypatch):
    folder = _moe_folder(tmp_path)
    _, base = _run(tmp_path / "a", folder, steps=1)
    assert base[0]["moe/route_mismatch"] == 0  # the CPU twins are batch invariant: no disagreement
    _planted(monkeypatch)
    _, hist = _run(tmp_path / "b", folder, steps=1)
    Ls = 2  # sparse layers: 0 and 2
    h = hist[0]
    assert h["moe/route_mismatch"] == pytest.approx(1 / Ls) and h["moe/route_mismatch_any"] == 1.0
    assert h["moe/route_mismatch_layer_max"] == 1.0
    assert h["mismatch/abs_mean"] == pytest.approx(base[0]["mismatch/abs_mean"], abs=1e-6)  # routes only logged
    _, rep = _run(tmp_path / "c", folder, steps=1, moe=dict(routing="replay"))
    # replay: the trainer takes the planted experts, so its logprobs leave the engine's
    # its own choice, still measured: the first layer's as before, a later layer's input now follows
    # the replayed experts of the first, so it may choose otherwise too
    assert rep[0]["moe/route_mismatch"] >= 1 / Ls and rep[0]["moe/route_mismatch_layer_max"] == 1.0
    assert rep[0]["mismatch/abs_mean"] > 100 * max(base[0]["mismatch/abs_mean"], 1e-7)


def test_replay_grpo_runs_with_recompute(tmp_path):
    """Replay through old_logprobs: recompute (its pass replays too: the first ratio is 1 there)."""
    folder = _moe_folder(tmp_path)
    tr, hist = _run(tmp_path, folder, steps=2, moe=dict(routing="replay"), old_logprobs="recompute")
    assert len(hist) == 2 and all(h["moe/route_mismatch"] == 0 for h in hist)
    assert torch.isfinite(torch.tensor([h["loss"] for h in hist])).all()


def test_lora_grpo_on_a_moe_model(tmp_path):
    """LoRA on a MoE model: attention on every layer and the sparse layers' experts adapted (one
    adapter an expert, PEFT's), the dense layer's MLP not (model/lora.py); GRPO runs with the base
    frozen, and in exact mode the engine (the expert adapters inside its decode graphs and prefill)
    gives the trainer's routes and logprobs bit for bit."""
    folder = _moe_folder(tmp_path)
    tr, hist = _run(tmp_path, folder, steps=2, exact=True, lora=dict(r=4, target_modules="all-linear"))
    lay = tr.model.lora.layout
    assert {m for (i, m) in lay.specs} == {"qkv", "o"} and sorted(lay.experts) == [i for i in range(3) if i != 1]
    assert all(h["moe/route_mismatch"] == 0 and h["mismatch/exact_frac"] == 1.0 for h in hist)
    assert torch.equal(tr.model.flat, rlcu.from_pretrained(folder).flat)  # the base frozen
    w = tr.model.lora.layout.views(tr.model.lora.flat)
    assert w["layers.0.qkv.B"].abs().sum() > 0 and w["layers.0.experts_gate_up.B"].abs().sum() > 0  # B trained
