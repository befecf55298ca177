"""A Hugging Face cache on disk, built by the tests (they never reach the network): repositories
of tiny models made by rlcu's own code and of data sets written as parquet, laid out as
huggingface_hub lays out its cache (<kind>s--org--name/refs/<branch> holding a commit,
snapshots/<commit>/<files>), and the environment that points huggingface_hub and datasets at it
offline."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# a tiny model's chat prompts and answers, in the words of its tokenizer (engine/cli.py's)
MATH_ROWS = [{"prompt": [{"role": "user", "content": f"what is {a} add {b} ?"}], "solution": str(int(a) + int(b))}
             for a, b in [("2", "3"), ("4", "5"), ("1", "1"), ("3", "3"), ("0", "7"), ("6", "2")]]
CHAT_ROWS = [{"source": "toy", "messages": [{"role": "user", "content": f"what is {a} add {b} ?"},
                                            {"role": "assistant", "content": f"the answer is {int(a) + int(b)}"}]}
             for a, b in [("2", "3"), ("4", "5"), ("1", "1"), ("3", "3")]]
# preference pairs as trl-lib/ultrafeedback_binarized holds them: chosen / rejected conversations (the prompt
# implicit: the user turn both share), their scores
PREFERENCE_ROWS = [{"score_chosen": 8.0, "score_rejected": 3.0,
                    "chosen": [{"role": "user", "content": f"what is {a} add {b} ?"},
                               {"role": "assistant", "content": f"the answer is {int(a) + int(b)}"}],
                    "rejected": [{"role": "user", "content": f"what is {a} add {b} ?"},
                                 {"role": "assistant", "content": f"the answer is {int(a) + int(b) + 1}"}]}
                   for a, b in [("2", "3"), ("4", "5"), ("1", "1"), ("3", "3")]]


def hub_env(monkeypatch, root: Path) -> Path:
    """Point huggingface_hub and datasets at a cache under `root`, offline; returns the Hub
    cache folder. Both packages read these variables once, at import: their constants are set
    too where they are imported already."""
    hub, ds = root / "hub", root / "datasets"
    env = {"HF_HOME": str(root), "HF_HUB_CACHE": str(hub), "HF_DATASETS_CACHE": str(ds), "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    if "huggingface_hub.constants" in sys.modules:
        c = sys.modules["huggingface_hub.constants"]
        monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    if "datasets.config" in sys.modules:
        c = sys.modules["datasets.config"]
        monkeypatch.setattr(c, "HF_DATASETS_CACHE", ds)
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    hub.mkdir(parents=True, exist_ok=True)
    return hub


def snapshot_dir(hub: Path, repo: str, kind: str = "model", revision: str = "main") -> Path:
    """The (new) snapshot folder of `repo` at branch or tag `revision`, its ref written."""
    folder = hub / f"{kind}s--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def add_model(hub: Path, repo: str, revision: str = "main", seed: int = 0) -> Path:
    """A tiny random Qwen3 with its word tokenizer (rlcu generate's smoke model) as the Hub
    repository `repo` at `revision`."""
    from rlcu.engine.cli import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer("cpu", seed=seed)
    snap = snapshot_dir(hub, repo, "model", revision)
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    return snap


def add_dataset(hub: Path, repo: str, splits: dict[str, list[dict]], revision: str = "main") -> Path:
    """The Hub dataset `repo`: one parquet file a split, named as the Hub names them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = snapshot_dir(hub, repo, "dataset", revision)
    (snap / "data").mkdir(exist_ok=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), snap / "data" / f"{split}-00000-of-00001.parquet")
    return snap
