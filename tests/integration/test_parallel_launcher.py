"""`kill -9` of torchrun: its ranks (their own session, so the signal does not reach them)
notice that their launcher is gone within seconds and end at once, writing nothing after, not
training on until the rendezvous store's bound (RLCU_DIST_HEARTBEAT_S, 60 s here) runs out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.parallel_util import torchrun_env, torchrun_sft

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _children(ppid: int) -> dict[int, str]:
    """{pid: start time} of ppid's child processes."""
    out = {}
    for d in Path("/proc").iterdir():
        st = _stat(int(d.name)) if d.name.isdigit() else None
        if st is not None and int(st[1]) == ppid:
            out[int(d.name)] = st[19]
    return out


def _alive(pid: int, start: str) -> bool:
    st = _stat(pid)
    return st is not None and st[19] == start and st[0] not in "ZX"


def _written(run: Path):
    ck = run / "checkpoints"
    return ((run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else "",
            sorted(p.name for p in ck.iterdir()) if ck.exists() else [])


def _kill_launcher(tmp_path: Path, argv: list[str], env: dict, n_ranks: int) -> dict:
    """Start argv (the launcher) in tmp_path, let its ranks train a few steps, SIGKILL the
    launcher alone; what followed: the ranks still alive 15 s later, whether anything was
    written in the second after they ended, and the launcher's output."""
    run, log = tmp_path / "run", tmp_path / "out.txt"
    with open(log, "w") as out:
        pr = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    ranks: dict[int, str] = {}
    try:
        end = time.monotonic() + 120
        while _written(run)[0].count("\n") < 3 and pr.poll() is None and time.monotonic() < end:
            time.sleep(0.1)  # training is under way, a few steps written
        assert pr.poll() is None and _written(run)[0].count("\n") >= 3, log.read_text()[-3000:]
        ranks = _children(pr.pid)
        assert len(ranks) == n_ranks, ranks
        pr.kill()
        pr.wait()
        t0 = time.monotonic()
        while any(_alive(p, s) for p, s in ranks.items()) and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        alive = [p for p, s in ranks.items() if _alive(p, s)]
        seen = _written(run)
        time.sleep(1.0)
        return {"alive": alive, "wrote_after": _written(run) != seen, "text": log.read_text()}
    finally:
        for p, s in ranks.items():
            if _alive(p, s):
                os.kill(p, signal.SIGKILL)  # the ranks this test started, should the fix fail
        if pr.poll() is None:
            pr.kill()
            pr.wait()


def test_killed_torchrun_ends_its_ranks(tmp_path):
    torchrun_sft(tmp_path, 1, steps=1_000_000, checkpoint={"every": 5, "keep_last": 2})
    got = _kill_launcher(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node", "2", "-m", "rlcu", "sft", "sft.yaml"], torchrun_env(60), 2)
    assert not got["alive"], f"ranks {got['alive']} still running 15 s after the kill"
    assert not got["wrote_after"]  # nothing written once they ended (no orphan left behind)
    assert all(f"rank {r} stops: its launcher" in got["text"] for r in range(2)), got["text"][-3000:]


def test_killed_launcher_ends_its_one_rank(tmp_path):
    """torchrun with one rank makes no process group (no watchdog): a stand-in for it (a
    session of its own for the rank, torchrun's variables) killed ends its rank all the same."""
    torchrun_sft(tmp_path, 1, steps=1_000_000, checkpoint={"every": 5, "keep_last": 2})
    launcher = ("import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', 'rlcu', 'sft', "
                "'sft.yaml'], start_new_session=True))")
    env = torchrun_env(60, TORCHELASTIC_RUN_ID="test", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    got = _kill_launcher(tmp_path, [sys.executable, "-c", launcher], env, 1)
    assert not got["alive"], f"ranks {got['alive']} still running 15 s after the kill"
    assert not got["wrote_after"]  # nothing written once they ended (no orphan left behind)
    assert all(f"rank {r} stops: its launcher" in got["text"] for r in range(1)), got["text"][-3000:]


def test_check_parent_ends_a_rank_whose_launcher_is_gone(monkeypatch, capsys):
    """What the thread runs every tick and a sharded checkpoint runs before it commits."""
    from rlcu.parallel import watchdog as wd

    class Exited(Exception):
        pass

    def _exit(code):
        raise Exited(code)

    w = wd.Watchdog(None, rank=1, size=2, timeout_s=60)
    w.check_parent()  # its launcher is there: nothing happens
    monkeypatch.setattr(wd.os, "_exit", _exit)
    w.parent += 1  # as if it had been reparented
    with pytest.raises(Exited, match=str(wd.EXIT_CODE)):
        w.check_parent()
    assert "rank 1 stops: its launcher" in capsys.readouterr().err
