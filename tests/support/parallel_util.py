"""N CPU ranks (gloo) for the tests: a function run on each in spawned processes, each bounded
by a timeout; and what a torchrun launch from a test takes (its environment, a tiny SFT run)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import traceback
from pathlib import Path

import torch.multiprocessing as mp
import yaml

import rlcu

SRC = str(Path(rlcu.__file__).resolve().parents[1])  # the rlcu this process runs: its children's path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, size, port, fn, args, out, env):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    import torch

    torch.set_num_threads(1)
    from rlcu.parallel import comm as W

    W.init_from_env()
    try:
        res = fn(rank, *args)
    except BaseException as e:
        W.report_failure(e)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(("ok", res), f)
    W.shutdown()


def run_ranks(fn, size: int, tmp_path, *args, timeout: float = 120, env: dict | None = None):
    """fn(rank, *args) on `size` ranks; returns (results by rank, exit codes). A result is
    ("ok", value), ("error", traceback) or None (the process died without writing one)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    out = str(tmp_path / "rank-result")
    env = {"RLCU_DIST_HEARTBEAT_S": "10", **(env or {})}
    ps = [ctx.Process(target=_entry, args=(r, size, port, fn, args, out, env)) for r in range(size)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(timeout)
    for p in ps:
        if p.is_alive():
            p.kill()
            p.join()
    res = []
    for r in range(size):
        try:
            with open(f"{out}.{r}", "rb") as f:
                res.append(pickle.load(f))
        except FileNotFoundError:
            res.append(None)
    return res, [p.exitcode for p in ps]


def ok(results):
    for r, x in enumerate(results):
        assert x is not None and x[0] == "ok", f"rank {r}: {x}"
    return [x[1] for x in results]


def torchrun_env(heartbeat_s: int, **kw) -> dict:
    """The environment of a torchrun launch: this rlcu on PYTHONPATH, one thread a rank, the
    ranks' heartbeat bound (RLCU_DIST_HEARTBEAT_S), no TRITON_INTERPRET; `kw` added."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RLCU_DIST_HEARTBEAT_S": str(heartbeat_s), **kw}
    env.pop("TRITON_INTERPRET", None)
    return env


def torchrun_sft(tmp_path, layers: int, **kw) -> None:
    """tmp_path/sft.yaml: SFT of a tiny model of `layers` layers on the CPU over 16 rows of token
    ids (tmp_path/data.jsonl), batch_tokens 16, logging to tmp_path/run; `kw` replaces
    top-level keys."""
    rows = [{"prompt_token_ids": [i % 61, (3 * i) % 61], "completion_token_ids": [(5 * i + j) % 61 for j in range(4)]}
            for i in range(16)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"tiny": {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": layers,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                              "max_position_embeddings": 64}, "device": "cpu"},
           "data": {"path": str(tmp_path / "data.jsonl")}, "batch_tokens": 16,
           "log": {"out_dir": str(tmp_path / "run"), "progress": False, "plot": False}, **kw}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
