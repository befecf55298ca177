"""The sort task's tokenizer and the tiny model sized to it (support/trainers.py's TINY with its
vocabulary and eos), and a tiny SFT run of them as the YAML file `rlcu sft` takes (the
command-line tests of the run folder and its failures)."""

from __future__ import annotations

import json

import yaml

from rlcu.data import synthetic as syn
from support import trainers

TOK = syn.make_tokenizer()
TINY = dict(trainers.TINY, vocab_size=TOK.vocab_size, eos_token_id=TOK.eos_token_id)


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
