"""A full disk (ENOSPC, simulated by making the writers fail midway) during a run: a
checkpoint that cannot be written fails with one OSError naming the file, "no space left on
device" and the previous checkpoint, which stays intact and loadable; metrics.jsonl and
log.txt writes say which file; the command line exits with its own status
(rlcu.errors.NO_SPACE_STATUS) and one line, not a traceback with torch's "unexpected
pos"; a disk already full at the start is refused at once, exit 2."""

from __future__ import annotations

import collections
import errno
import os

import pytest
import torch
from support.run_util import TINY, sft_yaml

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TORCH_SAVE = torch.save


def full_at(marker: str, error=None):
    """torch.save that writes a few bytes and fails as a full disk does once the path holds
    `marker` (by default with ENOSPC; torch itself says RuntimeError 'unexpected pos')."""

    def save(obj, f, *a, **kw):
        if marker not in str(f):
            return TORCH_SAVE(obj, f, *a, **kw)
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04" + bytes(60))
        raise error or OSError(errno.ENOSPC, "No space left on device")

    return save


def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _model_and_opt():
    import rlcu
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW

    m = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY), seed=0)
    return m, FlatAdamW(m, OptimConfig())


@pytest.mark.parametrize("how", ["enospc", "torch_unexpected_pos"])
def test_a_checkpoint_on_a_full_disk_fails_with_the_file_and_keeps_the_previous_one(tmp_path, monkeypatch, how):
    import shutil

    from rlcu.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    m, opt = _model_and_opt()
    save_checkpoint(tmp_path, 1, m, opt, {"k": 1}, keep_last=1)
    before = snapshot(tmp_path)
    err = None
    if how == "torch_unexpected_pos":  # what torch.save raises when the disk fills under it
        err = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 832 vs 726")
        Usage = collections.namedtuple("Usage", "total used free")
        monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 30, 1 << 30, 0))
    monkeypatch.setattr(torch, "save", full_at("step-000002", err))
    with pytest.raises(OSError) as ei:
        save_checkpoint(tmp_path, 2, m, opt, {"k": 2}, keep_last=1)  # keep_last=1 would prune step 1 after it
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "no space left on device" in msg and "optim.pt" in msg
    assert f"{tmp_path / 'step-000001'}, is intact" in msg and "unexpected pos" not in msg
    monkeypatch.undo()
    assert snapshot(tmp_path) == before  # no temp folder, the previous checkpoint untouched
    assert latest_checkpoint(tmp_path).name == "step-000001"
    assert load_checkpoint(tmp_path / "step-000001", *_model_and_opt())["k"] == 1


def test_a_rank_shard_on_a_full_disk_fails_the_same_way(tmp_path, monkeypatch):
    """The optimizer shards of data parallel (rlcu.parallel.ckpt), here at one rank: the same
    error; what the failed save left is cleared by the next one."""
    from rlcu.config import OptimConfig
    from rlcu.parallel.zero import ShardedAdamW
    from rlcu.train.checkpoint import save_checkpoint

    m, _ = _model_and_opt()
    opt = ShardedAdamW(m, OptimConfig())
    save_checkpoint(tmp_path, 1, m, opt, {}, keep_last=1)
    monkeypatch.setattr(torch, "save", full_at("rank-00000"))
    with pytest.raises(OSError) as ei:
        save_checkpoint(tmp_path, 2, m, opt, {}, keep_last=1)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "no space left on device" in msg and "rank-00000-of-00001" in msg
    assert f"{tmp_path / 'step-000001'}, is intact" in msg
    monkeypatch.undo()
    save_checkpoint(tmp_path, 2, m, opt, {}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


# ---------------------------------------------------------------- the command line
def the_error(capsys) -> str:
    """The one line the command printed about its end (stderr also has the run's progress)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    mine = [x for x in err.splitlines() if x.startswith("rlcu sft:")]
    assert len(mine) == 1, err
    return mine[0]


def test_cli_checkpoint_on_a_full_disk_exits_with_its_status(tmp_path, monkeypatch, capsys):
    from rlcu.errors import NO_SPACE_STATUS
    from rlcu.train.checkpoint import latest_checkpoint
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path, checkpoint={"every": 1, "keep_last": 1})
    monkeypatch.setattr(torch, "save", full_at("step-000002"))
    assert main(["sft", y]) == NO_SPACE_STATUS
    line = the_error(capsys)
    assert "no space left on device" in line and "step-000001, is intact" in line
    assert NO_SPACE_STATUS not in (0, 1, 2) and NO_SPACE_STATUS < 128
    ck = tmp_path / "out" / "checkpoints"
    assert latest_checkpoint(ck).name == "step-000001" and [p.name for p in ck.iterdir()] == ["step-000001"]


class _FullFile:
    """A text file whose writes fail as on a full disk after the first `ok` of them."""

    def __init__(self, fh, ok: int):
        self._fh, self._ok = fh, ok
        self.name = fh.name

    def write(self, text):
        if self._ok <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._ok -= 1
        return self._fh.write(text)

    def __getattr__(self, k):
        return getattr(self._fh, k)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


@pytest.mark.parametrize("which", ["_jsonl", "_log_txt"])
def test_cli_metrics_and_log_on_a_full_disk_exit_with_its_status(tmp_path, monkeypatch, capsys, which):
    from rlcu.errors import NO_SPACE_STATUS
    from rlcu.train.cli import main
    from rlcu.train.logging import RunLogger

    init = RunLogger.__init__

    def init_full(self, *a, **kw):
        init(self, *a, **kw)
        setattr(self, which, _FullFile(getattr(self, which), ok=1 if which == "_jsonl" else 4))  # mid-run

    monkeypatch.setattr(RunLogger, "__init__", init_full)
    assert main(["sft", sft_yaml(tmp_path, checkpoint={"every": 1, "keep_last": 1})]) == NO_SPACE_STATUS
    line = the_error(capsys)
    name = {"_jsonl": "metrics.jsonl", "_log_txt": "log.txt"}[which]
    assert "no space left on device" in line and str(tmp_path / "out" / name) in line


def test_cli_a_disk_full_at_the_start_is_refused_at_once(tmp_path, monkeypatch, capsys):
    from rlcu.train.cli import main

    y = sft_yaml(tmp_path, checkpoint={"every": 1, "keep_last": 1})

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    assert main(["sft", y]) == 2
    line = the_error(capsys)
    assert "no space left on device" in line and str(tmp_path / "out") in line
    assert not (tmp_path / "out").exists()  # nothing made, nothing left


def test_generate_output_on_a_full_disk_or_in_no_folder(tmp_path, monkeypatch, capsys):
    """rlcu generate's --output: a path it cannot write is refused before the model loads
    (exit 2); a full disk while writing is one line and the same status as the trainers'."""
    import rlcu.engine.cli as gen
    from rlcu.errors import NO_SPACE_STATUS

    for out, why in ((tmp_path / "none" / "o.jsonl", "is not a folder"), (tmp_path, "is a folder")):
        assert gen.main(["generate", "--max-tokens", "2", "--no-progress", "--output", str(out)]) == 2
        assert why in capsys.readouterr().err
    monkeypatch.setattr(gen, "open", lambda *a, **kw: _FullFile(open(*a, **kw), ok=1), raising=False)
    out = tmp_path / "o.jsonl"
    assert gen.main(["generate", "--max-tokens", "2", "--no-progress", "--output", str(out)]) == NO_SPACE_STATUS
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1] == f"rlcu generate: --output {out}: no space left on device"
