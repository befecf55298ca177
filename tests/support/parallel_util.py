"""Run a function on N CPU ranks (gloo) in spawned processes, each bounded by a timeout."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


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
