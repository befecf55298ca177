"""Reward-model training (train/reward_trainer.py): the Bradley-Terry loss and its gradients by
hand and against TRL 1.16's RewardTrainer.compute_loss on the same batch (with every parameter's
gradient from transformers' autograd through it), a synthetic preference task learned on the CPU,
the HF folder it saves, checkpoints and resume, and `rlcu rm`."""

import json

import pytest
import torch
from support.hf_util import make_seq_cls_model, rel_err

from rlcu.data.synthetic import make_tokenizer, sort_preference_rows
from rlcu.model.reward_model import RewardModel
from rlcu.train.reward_trainer import RewardTrainer, bt_loss

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_bt_loss_and_gradients_by_hand():
    rc = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.1, 0.4, -0.5], dtype=torch.float64, requires_grad=True)
    m = torch.tensor([0.0, 0.5, 1.0])
    loss, drc, drr = bt_loss(rc.detach(), rr.detach(), m, 4, center=0.05)
    d = rc - rr - m
    ref = (torch.log1p(torch.exp(-d)) + 0.05 * (rc + rr) ** 2).sum() / 4  # -log sigmoid(d) = log(1 + e^-d)
    ref.backward()
    assert abs(float(loss) - ref.item()) < 1e-6
    assert rel_err(drc, rc.grad) < 1e-6 and rel_err(drr, rr.grad) < 1e-6
    assert abs(float(bt_loss(rc.detach(), rr.detach(), m, 3)[0]) - float(torch.log1p(torch.exp(-d)).mean())) < 1e-6


def _pairs(n, V=333, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(1, V, (3 + i,), generator=g).tolist()
        out.append((p + torch.randint(1, V, (2 + i % 3,), generator=g).tolist(),
                    p + torch.randint(1, V, (4 - i % 2,), generator=g).tolist(), 0.25 * i))
    return out


def test_loss_and_every_gradient_match_trl_reward_trainer(tmp_path):
    """TRL's own compute_loss (margin and center_rewards_coefficient on) on a transformers model, its
    autograd gradients, against one rlcu step's loss and gradient buffer on the same weights. ~15 s
    on a loaded 2-core machine, most of it TRL's import and Trainer setup: the oracle is TRL itself."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    hf, folder = make_seq_cls_model(tmp_path, "qwen3", seed=5, pad_token_id=0)
    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(tok_dir)  # a pad token for TRL; the pairs are token ids
    tk = transformers.AutoTokenizer.from_pretrained(tok_dir)
    pairs = _pairs(5, pad=tk.pad_token_id)
    ds = datasets.Dataset.from_list([{"chosen_ids": c, "rejected_ids": r, "margin": m} for c, r, m in pairs])
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), report_to="none", center_rewards_coefficient=0.03,
                            use_cpu=True, max_length=None)
    tr = trl.RewardTrainer(model=hf, args=args, train_dataset=ds, processing_class=tk)
    hf.config.pad_token_id = tk.pad_token_id
    batch = tr.data_collator([ds[i] for i in range(len(pairs))])
    hf.train()
    hf.zero_grad()
    ref = tr.compute_loss(hf, dict(batch))
    ref.backward()

    rows = [{"chosen_token_ids": c, "rejected_token_ids": r, "margin": m} for c, r, m in pairs]
    cfg = {"batch_pairs": 5, "batch_tokens": 40, "center_rewards_coefficient": 0.03, "data": {"shuffle": False},
           "log": {"out_dir": str(tmp_path / "run"), "tensorboard": False, "plot": False, "progress": False},
           "optim": {"lr": 1e-3}}
    rm = RewardModel.from_pretrained(folder)
    t = RewardTrainer(cfg, dataset=rows, model=rm)
    grads = {}
    t.optimizer.step = lambda lr, loss: grads.update(g=t.model.grad_flat.clone()) or {}  # catch the gradient
    m = t._step(0)  # two micro-batches of 40 tokens
    assert abs(m["loss"] - float(ref)) < 1e-5
    rm.grad_flat = grads["g"]
    o = rm.layout.head_offset
    trunk = rm.trunk.layout.hf_views(grads["g"][:o])
    for name, p in hf.named_parameters():
        mine = grads["g"][o : o + rm.cfg.hidden_size].view(1, -1) if name == "score.weight" else trunk[name]
        assert rel_err(mine, p.grad) < 1e-4, name


def test_sort_preferences_learned_and_saved(tmp_path):
    """A tiny model from scratch learns that the chosen answer of the sort task is the ascending one:
    held-out accuracy from ~chance to >= 0.8 (chance is 0.5); the saved folder loads into
    transformers with the same scores; a resumed run takes the same steps. 30 steps in all (~10 s
    on an idle core): the learning check is the issue's acceptance test."""
    tok = make_tokenizer()
    rows, held = sort_preference_rows(400), sort_preference_rows(100, "eval")
    cfg = {"model": {"tiny": dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=64, eos_token_id=tok.eos_token_id)},
           "steps": 20, "batch_pairs": 32, "optim": {"lr": 3e-3, "warmup_steps": 5}, "eval_every": 10,
           "checkpoint": {"every": 10, "keep_last": 0},
           "log": {"out_dir": str(tmp_path / "run"), "tensorboard": False, "plot": False, "progress": False}}
    t = RewardTrainer(cfg, dataset=rows, eval_dataset=held, tokenizer=tok)
    hist = t.train()
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accs = [e["eval/accuracy"] for e in evals if "eval/accuracy" in e]
    assert accs[0] < 0.7 and accs[-1] >= 0.8, accs
    assert hist["accuracy"] > 0.8

    out = tmp_path / "run" / "reward_model"
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert back.config.pad_token_id == tok.pad_token_id
    seqs = [t.eval_pairs[i].chosen for i in range(4)] + [t.eval_pairs[i].rejected for i in range(4)]
    with torch.no_grad():
        ref = torch.stack([back(torch.tensor([s])).logits[0, 0] for s in seqs])
    assert rel_err(t.model.score(seqs), ref) < 1e-5

    cfg2 = {**cfg, "log": {**cfg["log"], "out_dir": str(tmp_path / "run2")},
            "checkpoint": {"resume": str(tmp_path / "run" / "checkpoints" / "step-000010")}}
    t2 = RewardTrainer(cfg2, dataset=rows, eval_dataset=held, tokenizer=tok)
    h2 = t2.train()
    assert t2.resumed_from is not None and abs(h2["loss"] - hist["loss"]) < 1e-5


def test_preference_example_is_the_sort_task():
    """examples/preference/: its data are sort_preference_rows' and its config loads (the task above)."""
    from pathlib import Path

    from rlcu.config import RMConfig, load_config

    ex = Path(__file__).resolve().parents[2] / "examples" / "preference"
    for name, rows in (("train", sort_preference_rows(400)), ("eval", sort_preference_rows(100, "eval"))):
        assert [json.loads(x) for x in (ex / f"{name}.jsonl").read_text().splitlines()] == rows
    cfg = load_config(RMConfig, ex / "rm.yaml")
    tok = make_tokenizer()
    assert cfg.model.tiny["vocab_size"] == tok.vocab_size and cfg.model.tiny["eos_token_id"] == tok.eos_token_id


def test_lora_trunk_full_head_merged_folder_and_resume(tmp_path):
    """lora: the trunk's base stays frozen while its adapters and the head train (gradient
    checkpointing auto resolved by the memory model); the final folder
    (adapters merged) loads into transformers with the live model's scores, the PEFT adapter is
    written beside it, and a run resumed from its step-2 checkpoint ends where the whole run does."""
    _, folder = make_seq_cls_model(tmp_path, "qwen3", seed=2)
    pairs = _pairs(12)
    rows = [{"chosen_token_ids": c, "rejected_token_ids": r, "margin": m} for c, r, m in pairs]

    def run(out, **ck):
        cfg = {"model": {"path": str(folder), "gradient_checkpointing": "auto"}, "steps": 4, "batch_pairs": 4,
               "optim": {"lr": 1e-2},
               "lora": {"r": 4, "alpha": 8, "init": "gaussian"}, "checkpoint": {"every": 2, **ck},
               "log": {"out_dir": str(tmp_path / out), "tensorboard": False, "plot": False, "progress": False}}
        t = RewardTrainer(cfg, dataset=rows)
        return t, t.train()

    t, _ = run("a")
    assert t.model.gradient_checkpointing == 2  # auto: every layer on the CPU (the memory model's answer)
    rm0 = RewardModel.from_pretrained(folder)
    o = rm0.layout.head_offset
    assert torch.equal(t.model.flat[:o], rm0.flat[:o])  # the base is frozen
    assert not torch.equal(t.model.head_w, rm0.head_w) and float(t.lora.flat.abs().sum()) > 0
    seqs = [c for c, _, _ in pairs[:3]] + [r for _, r, _ in pairs[:3]]
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a" / "reward_model")
    with torch.no_grad():
        ref = torch.stack([back(torch.tensor([s])).logits[0, 0] for s in seqs])
    assert rel_err(t.model.score(seqs), ref) < 1e-5
    assert (tmp_path / "a" / "adapter" / "adapter_config.json").is_file()

    t2, _ = run("b", resume=str(tmp_path / "a" / "checkpoints" / "step-000002"))
    assert t2.resumed_from is not None
    assert torch.equal(t2.lora.flat, t.lora.flat) and torch.equal(t2.model.head_w, t.model.head_w)
