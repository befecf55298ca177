"""A rank that dies or raises mid-step ends the other within the watchdog's bound, with a
message naming the rank and its error; without torchrun nothing distributed is set up."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from support.parallel_util import run_ranks
from support.trainers import sft_config, tiny, token_rows
from support.zero_util import zero_batches, zero_model, zero_optim


def _doomed(rank, how):
    from rlcu.parallel.zero import ShardedAdamW

    model = zero_model()
    opt = ShardedAdamW(model, zero_optim())
    for step in range(1000):
        seqs, n_tok = zero_batches(step % 4)
        model.zero_grad()
        for i, s in enumerate(seqs[rank::2]):
            if rank == 1 and step == 2 and i == 1:  # mid-step: rank 0 is inside a reduce-scatter
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("boom in the loss")
            model.forward(s, torch.tensor([0, len(s)], dtype=torch.int32))
            model.backward(torch.full((len(s),), -1.0 / n_tok))
        opt.step(1e-3)
    return "finished"


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_failed_rank_ends_the_other(tmp_path, capfd, how):
    t0 = time.monotonic()
    res, codes = run_ranks(_doomed, 2, tmp_path, how, timeout=90, env={"RLCU_DIST_HEARTBEAT_S": "3"})
    dt = time.monotonic() - t0
    err = capfd.readouterr().err
    from rlcu.parallel.watchdog import EXIT_CODE

    assert codes[0] == EXIT_CODE, (codes, err[-6000:])
    assert res[0] is None  # rank 0 never finished
    if how == "kill":
        assert codes[1] == -signal.SIGKILL
        assert "rank 0 stops: rank 1 failed: no heartbeat" in err
    else:
        assert res[1][0] == "error" and "boom in the loss" in res[1][1]
        assert "rank 0 stops: rank 1 failed: ValueError: boom in the loss" in err
    assert dt < 60


def test_one_process_sets_up_nothing(tmp_path, monkeypatch):
    import torch.distributed as dist

    from rlcu.optim import FlatAdamW
    from rlcu.parallel import comm
    from rlcu.train.sft import SFTTrainer

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert comm.init_from_env() == comm.World()
    tr = SFTTrainer(sft_config(tmp_path, "steps=1"), token_rows(4), model=tiny())
    tr.train()
    assert type(tr.optimizer) is FlatAdamW and tr.model.grad_sink is None
    assert not dist.is_initialized()
    assert comm.all_sum(3.5) == 3.5 and comm.all_max(2.0) == 2.0
    # torchrun with one rank is the same one-process run
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert comm.init_from_env() == comm.World() and not dist.is_initialized()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        comm.env_world()
