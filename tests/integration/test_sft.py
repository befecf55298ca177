"""SFT: loss and gradient against HF autograd (packed, completion-only, accumulated),
resume equivalence bit for bit, non-finite skipping and abort with a checkpoint, chat
data end to end."""

import json

import pytest
import torch
from support.trainers import SFT_TINY, V, sft_config, tiny, token_rows

import rlcu
from rlcu.data.tokenizer import make_word_tokenizer
from rlcu.train.sft import SFTTrainer

TIMING = ("tokens_per_s", "step_seconds")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_loss_and_grad_match_hf_autograd(tmp_path):
    from transformers import Qwen3ForCausalLM

    rows = token_rows(4)
    lens = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows]
    bt = max(lens[0] + lens[1], lens[2] + lens[3])  # two micro-batches of two examples
    tr = SFTTrainer(sft_config(tmp_path, "data.shuffle=false", f"batch_tokens={bt}", "grad_accum=2", "steps=1"),
                    rows, model=tiny())
    tr.model.save_pretrained(tmp_path / "hf")
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    total, n = 0.0, 0
    for r in rows:
        ids = torch.tensor(r["prompt_token_ids"] + r["completion_token_ids"])
        lp = torch.log_softmax(hf(ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
        mask = torch.zeros(len(ids) - 1)
        mask[max(0, len(r["prompt_token_ids"]) - 1):] = 1  # predictions of completion tokens
        total = total - (lp * mask).sum()
        n += int(mask.sum())
    loss = total / n
    loss.backward()
    m = tr.train_step()
    assert m["completion_tokens"] == n and m["sequences"] == 4
    assert abs(m["loss"] - loss.item()) < 1e-5 * loss.item()
    for name, p in hf.named_parameters():
        mine = tr.model.grads["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        err = float((mine - p.grad).norm() / p.grad.norm())
        assert err < 1e-4, (name, err)


def _rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_resume_is_bit_exact(tmp_path):
    rows = token_rows(10)
    sets = ["steps=6", "batch_tokens=24", "grad_accum=2", "optim.schedule=cosine", "optim.warmup_steps=2",
            "optim.weight_decay=0.1", "checkpoint.keep_last=1"]
    a = SFTTrainer(sft_config(tmp_path / "a", *sets), rows, model=tiny())
    a.train()
    b = SFTTrainer(sft_config(tmp_path / "b", *sets), rows, model=tiny())
    b.train(until=3)
    assert b.last_checkpoint.name == "step-000003"
    c = SFTTrainer(sft_config(tmp_path / "b", *sets, "checkpoint.resume=auto"), rows, model=tiny(seed=7))
    c.train()
    assert c.step == 6 and "resumed from" in (tmp_path / "b" / "log.txt").read_text()
    assert torch.equal(c.model.flat, a.model.flat)
    assert torch.equal(c.optimizer.m, a.optimizer.m) and torch.equal(c.optimizer.v, a.optimizer.v)
    ra, rc = _rows_of(tmp_path / "a" / "metrics.jsonl"), _rows_of(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in rc] == [1, 2, 3, 4, 5, 6]
    assert _strip(ra) == _strip(rc)  # every metric but wall-clock timings, bit for bit
    assert ra[-1]["epoch"] >= 1  # the run wrapped around the data
    final = tmp_path / "b" / "checkpoints" / "step-000006"
    assert sorted(p.name for p in final.parent.iterdir()) == ["step-000006"]
    assert torch.equal(rlcu.Qwen3.from_pretrained(final / "model").flat, a.model.flat)


def test_nonfinite_skip_and_abort(tmp_path):
    tr = SFTTrainer(sft_config(tmp_path, "steps=8", "batch_tokens=16", "optim.max_nonfinite_in_row=2",
                               "checkpoint.keep_last=0"), token_rows(6), model=tiny())
    forward, calls, snaps = tr.model.forward, [0], []

    def bad_forward(*a, **k):  # step 3 and steps 5.. produce a nan loss
        calls[0] += 1
        lp = forward(*a, **k)
        return lp * float("nan") if calls[0] == 3 or calls[0] >= 5 else lp

    tr.model.forward = bad_forward
    step = tr.train_step

    def recording_step(*a):
        out = step(*a)
        snaps.append(tr.model.flat.clone())
        return out

    tr.train_step = recording_step
    with pytest.raises(RuntimeError, match=r"2 optimizer steps in a row had a non-finite loss.*"
                                           r"last good state is saved in .*step-000006"):
        tr.train()
    rows = _rows_of(tmp_path / "metrics.jsonl")
    assert [r["skipped"] for r in rows] == [0, 0, 1, 0, 1, 1]
    assert torch.equal(snaps[2], snaps[1])  # a skipped step changes nothing
    saved = rlcu.Qwen3.from_pretrained(tmp_path / "checkpoints" / "step-000006" / "model")
    assert torch.equal(saved.flat, snaps[3]) and torch.equal(tr.model.flat, snaps[3])
    assert "step 3: non-finite loss" in (tmp_path / "log.txt").read_text()


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_sft_end_to_end(tmp_path):
    words = ["add", "one", "two", "three", "four", "five", "user", "assistant", "and"]
    tok = make_word_tokenizer(words, special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHATML)
    nums = ["one", "two", "three", "four", "five"]
    data = tmp_path / "sft.jsonl"
    lines = []
    for i in range(3):
        for j in range(2):
            q = f"add {nums[i]} and {nums[j]}"
            a = nums[i + j + 1]
            lines.append(json.dumps({"messages": [{"role": "user", "content": q},
                                                  {"role": "assistant", "content": a}]}))
            lines.append(json.dumps({"prompt": q, "completion": a}))
    lines.append(json.dumps({"prompt": "add " * 30, "completion": "one"}))  # too long: dropped with a count
    data.write_text("\n".join(lines) + "\n")
    held = tmp_path / "eval.jsonl"
    held.write_text("\n".join(lines[:2]) + "\n")
    cfg = sft_config(tmp_path / "run", f"data.path={data}", "steps=12", "batch_tokens=64", "optim.lr=1e-2",
                     "max_seq_len=24", "checkpoint.every=6", "log.every=3", f"data.eval_path={held}", "eval_every=6")
    tr = SFTTrainer(cfg, model=tiny(), tokenizer=tok)
    assert len(tr.examples) == 12
    tr.train()
    rows = _rows_of(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 3, 6, 9, 12]  # step 0: the baseline evaluation, before training
    base, rows = rows[0], rows[1:]
    assert sorted(base) == ["eval/loss", "step"] and rows[1]["eval/loss"] < base["eval/loss"]
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert "eval/loss" not in rows[0] and rows[-1]["eval/loss"] < rows[1]["eval/loss"]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "dropped 1 of 13 examples longer than max_seq_len=24" in log
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-000006", "step-000012"]
    assert (ck / "step-000012" / "model" / "tokenizer.json").exists()
    assert (tmp_path / "run" / "config.yaml").exists()
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="SFT needs data"):
        SFTTrainer(sft_config(tmp_path), model=tiny())
    with pytest.raises(ValueError, match=r"dataset\[1\]: an SFT row needs"):
        SFTTrainer(sft_config(tmp_path), [token_rows(1)[0], {"text": "x"}], model=tiny())
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        SFTTrainer(sft_config(tmp_path), [{"prompt_token_ids": [1], "completion_token_ids": [V]}], model=tiny())
    with pytest.raises(ValueError, match="text SFT rows need a tokenizer"):
        SFTTrainer(sft_config(tmp_path), [{"prompt": "a", "completion": "b"}], model=tiny())


def test_config_forms(tmp_path):
    f = tmp_path / "sft.yaml"
    f.write_text(f"log: {{out_dir: {tmp_path / 'r'}, progress: false}}\nsteps: 2\n")
    assert SFTTrainer(str(f), token_rows(3), model=tiny()).cfg.steps == 2
    tr = SFTTrainer({"steps": 3, "log": {"out_dir": str(tmp_path / "r")}, "data": {"eval_size": 1}},
                    token_rows(3), model=tiny())
    assert tr.cfg.steps == 3 and len(tr.examples) == 2 and len(tr.eval_examples) == 1


@pytest.mark.gpu
def test_sft_on_gpu_bf16(tmp_path):
    sets = ["steps=6", "batch_tokens=64", "grad_accum=2", "optim.lr=1e-2", "model.device=cuda"]
    m = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**SFT_TINY), device="cuda", dtype=torch.bfloat16)
    tr = SFTTrainer(sft_config(tmp_path, *sets), token_rows(4) * 4, model=m)
    assert tr.optimizer.master.dtype == torch.float32 and m.flat.dtype == torch.bfloat16
    tr.train()
    rows = _rows_of(tmp_path / "metrics.jsonl")
    assert all(r["skipped"] == 0 for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    m2 = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**SFT_TINY), device="cuda", dtype=torch.bfloat16, seed=3)
    tr2 = SFTTrainer(sft_config(tmp_path, *sets), token_rows(4) * 4, model=m2)
    tr2.resume(tr.last_checkpoint)
    assert torch.equal(m2.flat, m.flat) and torch.equal(tr2.optimizer.master, tr.optimizer.master)


def test_examples_longer_than_the_context_are_dropped(tmp_path):
    """max_seq_len above the model's context: an example longer than the context is dropped at
    load (with a count in the log), not a crash mid-run."""
    from rlcu.data import synthetic as syn
    from rlcu.train.sft import SFTTrainer

    tok = syn.make_tokenizer()
    rows = [{"prompt": "sort 3 1 2 :", "completion": " 1 2 3"}] * 4 + [{"prompt": "sort " + "1 " * 40 + ":",
                                                                       "completion": " 1"}]
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=24, tie_word_embeddings=True,
                rope_theta=10000.0, bos_token_id=None, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)
    cfg = {"model": {"tiny": tiny}, "max_seq_len": 1024, "steps": 1, "batch_tokens": 64,
           "log": {"out_dir": str(tmp_path / "out"), "progress": False, "tensorboard": False, "plot": False}}
    tr = SFTTrainer(cfg, rows, tokenizer=tok)
    assert len(tr.examples) == 4
    tr.train()
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "dropped 1 of 5 examples longer than the model's context (24; max_seq_len=1024)" in log
