"""A tiny SFT run on the synthetic sort task for the command-line tests of the run folder and
its failures (tests/test_run_dir.py, tests/test_disk_full.py): its tokenizer, model shape and
a YAML file that `rlcu sft` takes."""

from __future__ import annotations

import json

import yaml

from rlcu.data import synthetic as syn

TOK = syn.make_tokenizer()
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=32, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None,
            vocab_size=TOK.vocab_size, eos_token_id=TOK.eos_token_id)


def sft_yaml(tmp_path, **kw) -> str:
    """An SFT run of 2 steps as a YAML file under tmp_path; `kw` replaces top-level keys and
    merges into sections (`checkpoint={"every": 1}`)."""
    TOK.save_pretrained(tmp_path / "tok")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(12, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")
    cfg = {"model": {"tiny": dict(TINY), "tokenizer": str(tmp_path / "tok")},
           "data": {"path": str(tmp_path / "train.jsonl")}, "steps": 2, "batch_tokens": 64,
           "log": {"out_dir": str(tmp_path / "out"), "progress": False, "plot": False, "tensorboard": False}}
    for k, v in kw.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "run.yaml")
