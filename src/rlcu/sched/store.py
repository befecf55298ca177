"""The service's state in SQLite, so that a restarted service recovers its jobs and leases.

Every operation's writes are a savepoint inside one open transaction, committed before the
operation's reply leaves the service (WAL journal, synchronous=NORMAL: a commit survives a
kill -9 of the service); what a failed operation wrote is rolled back alone. Operations that
end while a commit is pending share it (group commit). Tables:

    meta(key, value)           the pool (capacity, device names, policy, aging), the metrics tally
    jobs(name, ...)            every job ever registered, with its state and times
    requests(id, ...)          pending phase requests (deleted when granted or dropped)
    leases(id, ..., end)       the leases: held (end null) and the ended ones of the retention window

Opening refuses what is not a scheduler's database (an empty file, a corrupt one, another
program's) with a message that names the file, unless `fresh`: then the old file is moved
aside (`sched.db.corrupt-<time>`, nothing deleted) and a new one begun.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

from rlcu.sched.metrics import Span
from rlcu.sched.pool import Request
from rlcu.sched.rows import Rows, StoreError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
  name TEXT PRIMARY KEY, clusters TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
  submitted REAL NOT NULL, started REAL, finished REAL, last_seen REAL NOT NULL,
  pid INTEGER, host TEXT, wait_s REAL NOT NULL DEFAULT 0, seq INTEGER NOT NULL, rollout_since REAL);
CREATE TABLE IF NOT EXISTS requests (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL, body TEXT NOT NULL, asked REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL, phase TEXT NOT NULL, cluster TEXT NOT NULL,
  devices TEXT NOT NULL, mem TEXT NOT NULL, start REAL NOT NULL, end REAL, reason TEXT NOT NULL DEFAULT '',
  yield_at REAL, request TEXT);
CREATE INDEX IF NOT EXISTS leases_end ON leases(end);
"""


AUTO_CHECKPOINT_PAGES = 20_000  # the backstop: ~80 MB of WAL


class StateLocked(StoreError):
    """Another live service holds the state folder."""


def lock_state(db: Path):
    """An exclusive lock on `<db>.lock`, held while the returned descriptor is open (the core
    holds it for its life: a second service on the state folder is refused)."""
    p = db.with_name(db.name + ".lock")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StateLocked(f"the scheduler state {db} is in use by another service (pid {holder}, lock {p}): "
                          "stop that one first, or give this one another state folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclasses.dataclass
class Job:
    """One job's record. `last_seen` is the service's monotonic clock (memory only: heartbeats
    are not written) and `born` its submission on the metrics clock (memory only, see
    Core.mtime); every other field is persisted."""

    name: str
    clusters: dict
    spec: dict
    state: str  # queued (submitted, its worker not attached yet), running, stopping (asked to), done, failed,
    #             cancelled, dead
    submitted: float
    seq: int
    started: float | None = None
    finished: float | None = None
    pid: int | None = None
    host: str | None = None
    wait_s: float = 0.0
    rollout_since: float | None = None  # the first request time of its yielded rollout (its age survives)
    last_seen: float = 0.0
    born: float = 0.0


JOB_FIELDS = ("name", "clusters", "spec", "state", "submitted", "started", "finished", "pid", "host", "wait_s",
              "seq", "rollout_since")


def request_to_json(r: Request | None) -> str | None:
    if r is None:
        return None
    return json.dumps({"id": r.id, "job": r.job, "phase": r.phase, "cluster": r.cluster, "devices": r.devices,
                       "mem": r.mem, "min_devices": r.min_devices, "work": r.work, "since": r.since,
                       "only": list(r.only) if r.only is not None else None})


def _move_aside(p: Path) -> Path:
    dst = p.with_name(f"{p.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    p.rename(dst)
    for ext in ("-wal", "-shm"):
        q = p.with_name(p.name + ext)
        if q.exists():
            q.rename(dst.with_name(dst.name + ext))
    return dst


class Store:
    def __init__(self, path: str | Path | None, *, fresh: bool = False):
        """path None: an in-memory database (nothing survives the process). A file that
        exists must be a scheduler's database (else StoreError, unless fresh)."""
        self.path = None if path is None else Path(path)
        self.rows = Rows(self.path)  # every row read back is checked (set rows.n_devices once the pool is known)
        self.moved: Path | None = None  # where `fresh` put an unusable old file
        self.in_tx = self.in_op = self.op_owns_tx = False
        self.writes = 0  # writes of the open operation
        self.tx_no, self.done_tx, self.commits = 1, 0, 0  # the open transaction's number, the last committed
        if self.path is not None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.path.exists():
                why = self._unusable()
                if why and not fresh:
                    raise StoreError(f"{self.path}: {why}; refusing to start on it (start with --fresh to move it "
                                     "aside and begin with an empty state)")
                if why or fresh:
                    self.moved = _move_aside(self.path)
        self.db = sqlite3.connect(":memory:" if self.path is None else str(self.path), check_same_thread=False,
                                  isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # checkpoints (which fsync) run from the ticker on a second connection, off the
        # service's lock (`checkpoint`); the automatic one is only a backstop
        self.db.execute(f"PRAGMA wal_autocheckpoint={AUTO_CHECKPOINT_PAGES}")
        self.db.executescript(_SCHEMA)
        self._ckpt, self._ckpt_lock, self.closed = None, threading.Lock(), False
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}
        if "rollout_since" not in cols:  # a database of an older version
            self.db.execute("ALTER TABLE jobs ADD COLUMN rollout_since REAL")

    def _unusable(self) -> str | None:
        """Why the existing file cannot be this service's state, or None."""
        if self.path.stat().st_size == 0:
            return "the database is empty (0 bytes): the state it held is gone"
        try:
            db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                ok = db.execute("PRAGMA quick_check").fetchone()[0]
                if ok != "ok":
                    return f"the database is corrupt ({ok})"
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if not {"meta", "jobs", "leases", "requests"} <= tables:
                    return "not a scheduler's database (no meta/jobs/leases/requests tables)"
                if db.execute("SELECT 1 FROM meta WHERE key='pool'").fetchone() is None:
                    return "the database holds no pool (it was emptied)"
            finally:
                db.close()
        except sqlite3.DatabaseError as e:
            return f"not a readable SQLite database ({e})"
        return None

    def close(self, meta: dict | None = None) -> None:
        """Commit what the operations kept, and `meta` (even with nothing else to commit), and
        close (also when that fails)."""
        try:
            self.rollback_op()
            for k, v in (meta or {}).items():
                self.set_meta(k, v)
            self.commit()
        finally:
            self.db.close()
        with self._ckpt_lock:
            self.closed = True
            if self._ckpt is not None:
                self._ckpt.close()

    def checkpoint(self) -> None:
        """Copy the WAL into the database (PASSIVE: never waits for, nor blocks, the writer).
        Thread-safe against the service's own connection: it uses a second one."""
        with self._ckpt_lock:
            if self.path is None or self.closed:
                return
            if self._ckpt is None:
                self._ckpt = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._ckpt.execute("PRAGMA wal_checkpoint(PASSIVE)")

    # ------------------------------------------------------------------ transactions
    # An operation's writes are one savepoint inside the open transaction: `end_op` keeps them
    # (and says which transaction holds them), `rollback_op` undoes them alone; `commit` ends
    # the transaction, with every kept operation in it (a group commit: the service replies to
    # an operation once the transaction that holds its writes is committed, see core.py).
    def _w(self, sql: str, args=()) -> None:
        if not self.in_tx:  # the operation opens the transaction: no savepoint needed
            self.db.execute("BEGIN IMMEDIATE")
            self.in_tx = self.in_op = self.op_owns_tx = True
        elif not self.in_op:
            self.db.execute("SAVEPOINT op")
            self.in_op, self.op_owns_tx = True, False
        self.writes += 1
        self.db.execute(sql, args)

    def end_op(self) -> int | None:
        """Keep the operation's writes; the number of the transaction that holds them (None: no writes)."""
        if not self.in_op:
            return None
        if not self.op_owns_tx:
            self.db.execute("RELEASE op")
        self.in_op, self.writes = False, 0
        return self.tx_no

    def rollback_op(self) -> None:
        """Undo the open operation's writes alone. Raises StoreError when SQLite has already
        rolled back the whole transaction (it may, on SQLITE_FULL or an I/O error): the
        operations kept in it are lost, which only the caller can answer for."""
        if self.in_op and self.op_owns_tx:
            self.rollback()
        elif self.in_op:
            if not self.db.in_transaction:
                self.rollback()
                raise StoreError(f"{self.path or 'the database'}: SQLite rolled back the open transaction (a full "
                                 "disk or an I/O error): the operations kept in it are lost")
            self.db.execute("ROLLBACK TO op")
            self.db.execute("RELEASE op")
        self.in_op, self.writes = False, 0

    def commit(self, meta: dict | None = None) -> None:
        """Commit the open transaction (an operation still open is kept first), writing `meta`
        (key -> value) in it. When that fails the transaction is rolled back and the error
        raised: nothing of it is written later (a meta written outside it, after SQLite had
        dropped it, would not match the rows)."""
        self.end_op()
        if self.in_tx:
            try:
                if not self.db.in_transaction:  # SQLite dropped it (SQLITE_FULL, I/O error)
                    raise StoreError(f"{self.path or 'the database'}: SQLite rolled back the open transaction "
                                     "(a full disk or an I/O error)")
                for k, v in (meta or {}).items():
                    self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (k, json.dumps(v)))
                self.db.execute("COMMIT")
            except BaseException:
                self.rollback()
                raise
            self.commits += 1
            self.done_tx = self.tx_no
            self.tx_no += 1
        self.in_tx = False

    def rollback(self) -> None:
        """Undo the whole open transaction (every kept operation not committed yet); the
        transaction's number is never committed."""
        try:
            if self.in_tx and self.db.in_transaction:
                self.db.execute("ROLLBACK")
        finally:
            if self.in_tx:
                self.tx_no += 1
            self.in_tx, self.in_op, self.writes = False, False, 0

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str):
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else self.rows.meta(key, row[0])

    def set_meta(self, key: str, value) -> None:
        self._w("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, json.dumps(value)))

    # ------------------------------------------------------------------ jobs
    def put_job(self, job: Job) -> None:
        row = [json.dumps(getattr(job, k)) if k in ("clusters", "spec") else getattr(job, k) for k in JOB_FIELDS]
        self._w(f"INSERT OR REPLACE INTO jobs({', '.join(JOB_FIELDS)}, last_seen) "
                f"VALUES({', '.join('?' * len(row))}, ?)", (*row, time.time()))

    def jobs(self) -> list[Job]:
        out = []
        for row in self.db.execute(f"SELECT {', '.join(JOB_FIELDS)} FROM jobs ORDER BY seq"):
            out.append(Job(**self.rows.job(dict(zip(JOB_FIELDS, row)))))
        return out

    # ------------------------------------------------------------------ requests
    def put_request(self, r: Request, asked: float) -> None:
        self._w("INSERT OR REPLACE INTO requests(id, job, body, asked) VALUES(?, ?, ?, ?)",
                (r.id, r.job, request_to_json(r), asked))

    def drop_request(self, rid: int) -> None:
        self._w("DELETE FROM requests WHERE id=?", (rid,))

    def requests(self) -> list[tuple[Request, float]]:
        return [(self.rows.request("requests", f"id={i}", "body", b), a)
                for i, b, a in self.db.execute("SELECT id, body, asked FROM requests ORDER BY id")]

    # ------------------------------------------------------------------ leases
    def put_lease(self, s: Span, request: Request | None, yield_at: float | None) -> None:
        """A new (or rewritten) lease row."""
        self._w("INSERT OR REPLACE INTO leases(id, job, phase, cluster, devices, mem, start, end, reason, "
                "yield_at, request) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (s.id, s.job, s.phase, s.cluster, json.dumps(list(s.devices)), json.dumps(list(s.mem)),
                 s.start, s.end, s.reason, yield_at, request_to_json(request)))

    def end_lease(self, s: Span) -> None:
        self._w("UPDATE leases SET end=?, reason=? WHERE id=?", (s.end, s.reason, s.id))

    def set_yield(self, lease_id: int, at: float) -> None:
        self._w("UPDATE leases SET yield_at=? WHERE id=?", (at, lease_id))

    def _spans(self, where: str, args=()) -> list[tuple[Span, Request | None, float | None]]:
        q = f"SELECT id, job, phase, cluster, devices, mem, start, end, reason, yield_at, request FROM leases {where}"
        return [self.rows.span(r) for r in self.db.execute(q, args)]

    def lease(self, lease_id: int) -> Span | None:
        rows = self._spans("WHERE id=?", (lease_id,))
        return rows[0][0] if rows else None

    def held_leases(self) -> list[tuple[Span, Request | None, float | None]]:
        return self._spans("WHERE end IS NULL ORDER BY id")

    def recent_leases(self, n: int) -> list[tuple[Span, Request | None, float | None]]:
        """The last n ended leases, oldest first."""
        return self._spans("WHERE end IS NOT NULL ORDER BY id DESC LIMIT ?", (n,))[::-1] if n > 0 else []

    def leases(self) -> list[tuple[Span, Request | None, float | None]]:
        """Every lease row (held and retained history), by id."""
        return self._spans("ORDER BY id")

    def top_id(self) -> int:
        a = self.db.execute("SELECT MAX(id) FROM leases").fetchone()[0] or 0
        b = self.db.execute("SELECT MAX(id) FROM requests").fetchone()[0] or 0
        return max(a, b)

    def history_rows(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM leases WHERE end IS NOT NULL").fetchone()[0]

    def prune(self, before: float, excess: int, limit: int = 5000) -> int:
        """Delete up to `limit` ended leases: those that ended before `before`, and the `excess`
        oldest ended ones (by id); returns how many. Both walk an index from its start."""
        ids = {r[0] for r in self.db.execute("SELECT id FROM leases WHERE end IS NOT NULL AND end < ? ORDER BY end "
                                             "LIMIT ?", (before, limit))}
        if excess > 0 and len(ids) < limit:
            ids.update(r[0] for r in self.db.execute("SELECT id FROM leases WHERE end IS NOT NULL ORDER BY id LIMIT ?",
                                                     (min(excess, limit - len(ids)),)))
        if ids:
            self._w(f"DELETE FROM leases WHERE id IN ({', '.join('?' * len(ids))})", sorted(ids))
        return len(ids)
