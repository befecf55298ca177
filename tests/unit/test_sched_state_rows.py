"""A damaged row of the state database is refused at start with one line naming the file,
the table, the row and the column (a device outside the pool was an IndexError traceback,
bad JSON a bare "Expecting value"); `rlcu sched serve` exits 2 on it."""

import shutil
import sqlite3

import pytest
from support.sched_util import SPEC, ok

from rlcu.sched.cli import main
from rlcu.sched.core import Core, StoreError
from rlcu.sched.server import SchedServer


@pytest.fixture(scope="module")
def good_state(tmp_path_factory):
    """A state with a held lease (a), an ended one (b) and a pending request (c)."""
    d = tmp_path_factory.mktemp("good")
    core = Core([8.0], state=d / "sched.db")
    for j in ("a", "b", "c"):
        ok(core, op="register", job=j, clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=6)
    ok(core, op="request", job="b", phase="values", mem=1)
    ok(core, op="finish", job="b")
    ok(core, op="request", job="c", phase="values", mem=6)  # waits for a
    core.close()
    return d


CASES = [
    ("UPDATE leases SET devices='[5]' WHERE job='a'", "table leases, row id=", "device 5 is outside the pool"),
    ("UPDATE leases SET devices='[3]' WHERE job='b'", "table leases, row id=", "device 3 is outside the pool"),
    ("UPDATE leases SET mem='' WHERE job='a'", "table leases, row id=", "column mem: not valid JSON"),
    ("UPDATE leases SET mem='[1, 2]' WHERE job='a'", "table leases, row id=", "column mem: 1 memory amounts"),
    ("UPDATE jobs SET clusters='{' WHERE name='a'", "table jobs, row name='a'", "column clusters: not valid JSON"),
    ("UPDATE jobs SET spec='[]' WHERE name='c'", "table jobs, row name='c'", "column spec: a mapping"),
    ("UPDATE requests SET body='nope' WHERE job='c'", "table requests, row id=", "column body: not valid JSON"),
    ("UPDATE requests SET body='{\"id\": 1}' WHERE job='c'", "table requests, row id=", "not a phase request"),
    ("UPDATE meta SET value='x' WHERE key='pool'", "table meta, row key='pool'", "not valid JSON"),
    ("UPDATE meta SET value='{\"capacity\": [8], \"names\": [], \"policy\": \"phase\", \"aging_s\": 60, \"t0\": 0}' "
     "WHERE key='pool'", "table meta, row key='pool'", "names must be 1 device names"),
    ("UPDATE meta SET value='{\"tally\": 3}' WHERE key='live'", "table meta, row key='live'", "tally"),
    ("UPDATE leases SET cluster='zz' WHERE job='a'", "does not fit its pool and jobs", "cluster 'zz'"),
]


@pytest.mark.parametrize("sql, where, why", CASES)
def test_a_damaged_row_is_refused_naming_table_row_and_file(good_state, tmp_path, sql, where, why):
    state = tmp_path / "state"
    shutil.copytree(good_state, state)
    db = sqlite3.connect(state / "sched.db")
    db.execute(sql)
    db.commit()
    db.close()
    with pytest.raises(StoreError) as e:
        Core(None, state=state / "sched.db")
    msg = str(e.value)
    assert str(state / "sched.db") in msg and where in msg and why in msg and "\n" not in msg


def test_serve_exits_2_on_a_damaged_row(good_state, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLCU_SCHED_TOKEN", raising=False)
    monkeypatch.setattr(SchedServer, "serve_forever", lambda self: self.stop())  # (were it to start)
    state = tmp_path / "state"
    shutil.copytree(good_state, state)
    db = sqlite3.connect(state / "sched.db")
    db.execute("UPDATE leases SET devices='[7]' WHERE job='b'")
    db.commit()
    db.close()
    assert main(["sched", "serve", "--state", str(state)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "table leases" in err and "device 7 is outside the pool" in err
