"""The service's state in SQLite, so that a restarted service recovers its jobs and leases.

Every change is written through (WAL journal, one transaction per operation) before the
reply leaves the service, so what a client was told survives a crash. Tables:

    meta(key, value)           the pool (capacity, device names), policy, aging
    jobs(name, ...)            every job ever registered, with its state and times
    requests(id, ...)          pending phase requests (deleted when granted or dropped)
    leases(id, ..., end)       every lease ever granted; end is null while it is held
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from rlcu.sched.metrics import Span
from rlcu.sched.pool import Request

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
  name TEXT PRIMARY KEY, clusters TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
  submitted REAL NOT NULL, started REAL, finished REAL, last_seen REAL NOT NULL,
  pid INTEGER, host TEXT, wait_s REAL NOT NULL DEFAULT 0, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL, body TEXT NOT NULL, asked REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL, phase TEXT NOT NULL, cluster TEXT NOT NULL,
  devices TEXT NOT NULL, mem TEXT NOT NULL, start REAL NOT NULL, end REAL, reason TEXT NOT NULL DEFAULT '',
  yield_at REAL, request TEXT);
"""

JOB_FIELDS = ("name", "clusters", "spec", "state", "submitted", "started", "finished", "last_seen", "pid", "host",
              "wait_s", "seq")


def request_to_json(r: Request | None) -> str | None:
    if r is None:
        return None
    d = {k: getattr(r, k) for k in Request.__dataclass_fields__}
    d["only"] = list(r.only) if r.only is not None else None
    return json.dumps(d)


def request_from_json(s: str | None) -> Request | None:
    if s is None:
        return None
    d = json.loads(s)
    d["only"] = tuple(d["only"]) if d.get("only") is not None else None
    return Request(**d)


class Store:
    def __init__(self, path: str | Path | None):
        """path None: an in-memory database (nothing survives the process)."""
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(":memory:" if self.path is None else str(self.path), check_same_thread=False,
                                  isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def tx(self):
        """`with store.tx():` one transaction."""
        return _Tx(self.db)

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str):
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, json.dumps(value)))

    # ------------------------------------------------------------------ jobs
    def put_job(self, job: dict) -> None:
        row = [json.dumps(job[k]) if k in ("clusters", "spec") else job[k] for k in JOB_FIELDS]
        self.db.execute(f"INSERT OR REPLACE INTO jobs({', '.join(JOB_FIELDS)}) VALUES({', '.join('?' * len(row))})",
                        row)

    def jobs(self) -> list[dict]:
        out = []
        for row in self.db.execute(f"SELECT {', '.join(JOB_FIELDS)} FROM jobs ORDER BY seq"):
            d = dict(zip(JOB_FIELDS, row))
            d["clusters"], d["spec"] = json.loads(d["clusters"]), json.loads(d["spec"])
            out.append(d)
        return out

    # ------------------------------------------------------------------ requests
    def put_request(self, r: Request, asked: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO requests(id, job, body, asked) VALUES(?, ?, ?, ?)",
                        (r.id, r.job, request_to_json(r), asked))

    def drop_request(self, rid: int) -> None:
        self.db.execute("DELETE FROM requests WHERE id=?", (rid,))

    def requests(self) -> list[tuple[Request, float]]:
        return [(request_from_json(b), a) for b, a in self.db.execute("SELECT body, asked FROM requests ORDER BY id")]

    # ------------------------------------------------------------------ leases
    def put_lease(self, s: Span, request: Request | None, yield_at: float | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO leases(id, job, phase, cluster, devices, mem, start, end, reason, "
                        "yield_at, request) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (s.id, s.job, s.phase, s.cluster, json.dumps(list(s.devices)), json.dumps(list(s.mem)),
                         s.start, s.end, s.reason, yield_at, request_to_json(request)))

    def leases(self) -> list[tuple[Span, Request | None, float | None]]:
        out = []
        q = ("SELECT id, job, phase, cluster, devices, mem, start, end, reason, yield_at, request "
             "FROM leases ORDER BY id")
        for row in self.db.execute(q):
            s = Span(row[0], row[1], row[2], row[3], tuple(json.loads(row[4])), tuple(json.loads(row[5])), row[6],
                     row[7], row[8])
            out.append((s, request_from_json(row[10]), row[9]))
        return out


class _Tx:
    def __init__(self, db):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type, *_):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
