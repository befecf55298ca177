"""The run folder (rlcu.train.run_dir): `--resume auto` with no checkpoint to resume takes
only a run killed before its first checkpoint (a finished run, or one whose checkpoints are
elsewhere, is refused with one line and left as it was); a save at any number of ranks
clears the shard folders a killed sharded save left, and `--overwrite` removes everything a
run writes (shard folders, every curve, the W&B run id, <out_dir>/checkpoints when
checkpoint.dir is elsewhere) and nothing else; the start refuses an out_dir it cannot write."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from support.run_util import TINY, sft_yaml

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py



def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_refusal(capsys, *want) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in want:
        assert w in err, err
    return err


# ---------------------------------------------------------------- --resume auto without a checkpoint
def test_resume_auto_keeps_a_finished_run_without_checkpoints(tmp_path, capsys):
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path, checkpoint={"save_at_end": False})
    assert main(["sft", y]) == 0
    out = tmp_path / "out"
    before = snapshot(out)
    assert {"metrics.jsonl", "log.txt", "config.yaml"} <= set(before)
    capsys.readouterr()
    assert main(["sft", y, "--resume", "auto"]) == 2
    one_line_refusal(capsys, "finished (2 of 2 steps)", "--overwrite")
    assert snapshot(out) == before  # nothing removed, nothing written


def test_resume_auto_keeps_a_run_whose_checkpoints_are_elsewhere(tmp_path, capsys):
    from rlcu.train.cli import main

    ck = tmp_path / "ck"
    y = sft_yaml(tmp_path, checkpoint={"dir": str(ck)})
    assert main(["sft", y]) == 0
    out = tmp_path / "out"
    before, ck_before = snapshot(out), snapshot(ck)
    capsys.readouterr()
    # the same run resumed without its checkpoint.dir: nothing under out/checkpoints
    assert main(["sft", y, "--set", "checkpoint.dir=null", "--resume", "auto"]) == 2
    one_line_refusal(capsys, f"checkpoint.dir={ck}")
    assert snapshot(out) == before and snapshot(ck) == ck_before
    assert main(["sft", y, "--resume", "auto"]) == 0  # with it: resumed (nothing left to do)


def test_resume_auto_restarts_a_run_killed_before_its_first_checkpoint(tmp_path):
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path, checkpoint={"every": 2})
    out = tmp_path / "out"
    assert main(["sft", y]) == 0
    want = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # what a kill after step 1 (before the checkpoint at step 2) leaves: config, log, one row, no checkpoint
    (out / "metrics.jsonl").write_text(json.dumps(want[0]) + "\n")
    shutil.rmtree(out / "checkpoints")
    killed_log = (out / "log.txt").read_text()
    assert main(["sft", y, "--resume", "auto"]) == 0
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2] and [r["loss"] for r in got] == [r["loss"] for r in want]
    log = (out / "log.txt").read_text()
    assert log.startswith(killed_log) and "stopped before its first checkpoint" in log  # the log goes on


def test_resume_auto_refuses_a_run_whose_checkpoints_went_missing(tmp_path, capsys):
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path, checkpoint={"every": 1}, steps=3)
    out = tmp_path / "out"
    assert main(["sft", y]) == 0
    # a run killed after step 2, whose checkpoints (steps 1, 2) were then moved away
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n")
    shutil.rmtree(out / "checkpoints")
    before = snapshot(out)
    capsys.readouterr()
    assert main(["sft", y, "--resume", "auto"]) == 2
    one_line_refusal(capsys, "logged step 2, past its first checkpoint (step 1)")
    assert snapshot(out) == before


# ---------------------------------------------------------------- what a killed save and --overwrite leave
def _killed_sharded_save(root, step: int, ranks: int = 2):
    """What a run of `ranks` ranks killed while writing its shards leaves (rlcu.parallel.ckpt)."""
    d = root / f".shards-step-{step:06d}" / "optim"
    d.mkdir(parents=True)
    for r in range(ranks - 1):  # the last rank had not written its file yet
        torch.save({"m": torch.zeros(4)}, d / f"rank-{r:05d}-of-{ranks:05d}.pt")
    return d.parent


def test_a_one_process_save_clears_a_killed_sharded_save(tmp_path):
    import rlcu
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW
    from rlcu.train.checkpoint import save_checkpoint

    model = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY), seed=0)
    opt = FlatAdamW(model, OptimConfig())
    save_checkpoint(tmp_path, 2, model, opt, {}, keep_last=1)
    stale = _killed_sharded_save(tmp_path, 3)  # the 2-rank run, killed saving step 3; resumed at 1 process
    save_checkpoint(tmp_path, 3, model, opt, {}, keep_last=1)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]


def test_overwrite_removes_everything_a_run_wrote_and_nothing_else(tmp_path):
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path)
    out = tmp_path / "out"
    assert main(["sft", y]) == 0
    _killed_sharded_save(out / "checkpoints", 4)
    for name in ("curves.png", "loss_curve.png", "wandb_run_id", "notes.md"):
        (out / name).write_text("x")
    assert main(["sft", y, "--overwrite"]) == 0
    names = {p.name for p in out.iterdir()}
    assert not names & {"curves.png", "loss_curve.png", "wandb_run_id"} and "notes.md" in names
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    # a run with its checkpoints elsewhere replaces the one in out/checkpoints too: a later
    # `--resume auto` with the default checkpoint.dir would take it for this run's
    assert main(["sft", y, "--overwrite", "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "steps=1"]) == 0
    assert not list((out / "checkpoints").iterdir())
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000001"]


# ---------------------------------------------------------------- a run folder that cannot be written
def test_an_out_dir_that_is_a_file_is_refused_at_the_start(tmp_path, capsys):
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path)
    (tmp_path / "afile").write_text("mine")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main(["sft", y, "--set", f"log.out_dir={out}"]) == 2
        one_line_refusal(capsys, str(out), f"{tmp_path / 'afile'} is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "mine"


def test_check_writable_names_the_folder_and_why(tmp_path, monkeypatch):
    import errno

    from rlcu.errors import SetupError
    from rlcu.train import run_dir

    run_dir.check_writable(tmp_path / "new" / "deeper")  # a folder to be made: its parent is probed
    assert not (tmp_path / "new").exists() and not list(tmp_path.iterdir())  # nothing made, no probe left
    for code, why in ((errno.EACCES, "permission denied"), (errno.EROFS, "read-only file system"),
                      (errno.ENOSPC, "no space left on device")):
        def refuse(*a, code=code, **kw):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(run_dir, "open", refuse, raising=False)
        with pytest.raises(SetupError, match=f"^{tmp_path / 'out'}: cannot write the run's files there: {why}"):
            run_dir.check_writable(tmp_path / "out")
