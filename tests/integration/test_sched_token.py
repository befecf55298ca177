"""The service token is never empty nor a fragment: `<state>/token` is written atomically (a
failed write leaves the old token), a saved token that is empty, cut short or unreadable is
refused at start with one line (exit 2), and no other door takes "" as a token: `--token ""`,
an empty `--token-file`, an empty token file a client finds, a `Front` given ""."""

import errno
import os

import pytest

from rlcu.sched.cli import main
from rlcu.sched.client import SchedError, find_token
from rlcu.sched.core import Core
from rlcu.sched.server import SchedServer, load_token
from rlcu.sched.service import Front

GOOD = "0123456789abcdef0123456789abcdef"


def test_a_failed_token_write_leaves_the_old_token(tmp_path, monkeypatch):
    assert load_token(tmp_path, GOOD) == GOOD
    real = os.fdopen

    class Full:  # the file the token is written to, on a full disk
        def __init__(self, fd, *a, **k):
            self.f = real(fd, *a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", Full)
    with pytest.raises(OSError, match=r"no space left on device while writing .*token"):
        load_token(tmp_path, "another-token")
    monkeypatch.undo()
    assert load_token(tmp_path) == GOOD  # not "" (every secret computable), not a fragment
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]  # no temporary file left


@pytest.mark.parametrize("content, why", [(b"", "is empty"), (b"\n", "is empty"), (b"0123456789ab", "cut short"),
                                          (b"\xff\xfe\n", "cannot read")])
def test_a_bad_saved_token_is_refused(tmp_path, content, why):
    (tmp_path / "token").write_bytes(content)
    with pytest.raises(ValueError, match=why) as e:
        load_token(tmp_path)
    assert str(tmp_path / "token") in str(e.value) and "\n" not in str(e.value)


def test_serve_refuses_an_empty_token_file_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLCU_SCHED_TOKEN", raising=False)
    # (were it to start, it must not serve forever here)
    monkeypatch.setattr(SchedServer, "serve_forever", lambda self: self.stop())
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "token").write_text("")
    assert main(["sched", "serve", "--state", str(state), "--cpu-slots", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "token" in err and "is empty" in err and len(err.splitlines()) == 1
    assert not (state / "sched.db").exists()  # refused before anything else is made


def test_no_door_takes_an_empty_token(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLCU_SCHED_TOKEN", raising=False)
    monkeypatch.setattr(SchedServer, "serve_forever", lambda self: self.stop())
    state = tmp_path / "state"
    assert main(["sched", "serve", "--state", str(state), "--cpu-slots", "1", "--token", ""]) == 2
    assert "--token is empty" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert main(["sched", "serve", "--state", str(state), "--cpu-slots", "1", "--token-file",
                 str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err
    with pytest.raises(SchedError, match="is empty"):
        find_token("unix:/nonexistent/sched.sock", token_file=tmp_path / "empty")
    (state / "token").write_text("")
    with pytest.raises(SchedError, match="is empty"):
        find_token(f"unix:{state / 'sched.sock'}")  # the token file beside the socket
    core = Core([1.0])
    with pytest.raises(ValueError, match="empty"):
        Front(core, "")
    core.close()
    with pytest.raises(ValueError, match="empty"):
        load_token(tmp_path / "other", "")
