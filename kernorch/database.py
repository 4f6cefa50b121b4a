"""The profile database: every measurement, appended, never rewritten (SQLite, WAL).

A measurement is keyed by (target fingerprint, kernel key, implementation, schedule, versions).
Each row is committed the moment it exists, so a killed run loses nothing it measured; a second
run on the same model finds everything and measures nothing (and, in `estimates` and `solutions`,
where the first run's estimates of the fusions it never measured ended, and the blocks of its
orchestration program already solved; in `comparisons`, over a range, how its whole executables
timed against each other, so the second run takes the same decisions). A key measured more than once
(`measure --remeasure`) counts its fastest measurement: other work on the machine only ever makes
a kernel slower.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    target TEXT NOT NULL,
    key TEXT NOT NULL,
    impl TEXT NOT NULL,
    schedule TEXT NOT NULL,
    versions TEXT NOT NULL,
    status TEXT NOT NULL,          -- ok | refused | failed (a crashed or timed-out worker: measured again)
    median_ns INTEGER,             -- NULL when refused
    runs_ns TEXT,                  -- JSON list of per-repeat times
    reason TEXT,                   -- why refused
    build_s REAL,
    description TEXT,              -- human-readable: the ops inside
    created REAL NOT NULL,
    samples_ns TEXT                -- a kernel over a range: JSON [[length, median ns], ...] per length timed ([[batch, seq], ns] over several symbols)
);
CREATE INDEX IF NOT EXISTS by_key ON measurements(target, key, impl, schedule, versions);
CREATE TABLE IF NOT EXISTS estimates (  -- a run's last estimates of the fusions it never measured
    key TEXT PRIMARY KEY,               -- digest of the run's jobs, machine, tools and cost model
    estimates TEXT NOT NULL,            -- JSON [[key, impl, schedule, ns], ...]
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS solutions (  -- proven solutions of orchestration blocks (kernorch.blocks)
    key TEXT PRIMARY KEY,               -- digest of the block's program: its kernels, their costs, its state
    solution TEXT NOT NULL,             -- JSON
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS comparisons (  -- two whole executables timed in turns (kernorch.executed.compared)
    key TEXT PRIMARY KEY,                 -- digest: both executables' libraries, the inputs' shape, the machine, the turn
    comparison TEXT NOT NULL,             -- JSON [first's time over second's, first's s, second's s]
    created REAL NOT NULL
);
"""

@dataclass(frozen=True)
class Measurement:
    target: str
    key: str
    impl: str
    schedule: str
    versions: str
    status: str
    median_ns: int | None
    runs_ns: tuple[int, ...] = ()
    reason: str = ""
    build_s: float = 0.0
    description: str = ""
    # a kernel over a symbolic dimension: (value, median ns) at each value it was timed at (its
    # median_ns is their weighted sum); a value of weight 0 was timed to be seen, not counted
    samples_ns: tuple[tuple[int | tuple[int, ...], int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ProfileDB:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path), timeout=30)
        # Switching to WAL and creating the schema take an exclusive lock that SQLite does not wait
        # for: a second process opening the same new database at that moment gets "database is
        # locked" at once. Retry for as long as the connection's own timeout.
        deadline = time.monotonic() + 30
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.executescript(SCHEMA)
                self._add_missing_columns()
                self.conn.commit()
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _add_missing_columns(self) -> None:
        """A database written before a column existed gets it (empty in its old rows)."""
        have = {row[1] for row in self.conn.execute("PRAGMA table_info(measurements)")}
        if "samples_ns" not in have:
            try:
                self.conn.execute("ALTER TABLE measurements ADD COLUMN samples_ns TEXT")
            except sqlite3.OperationalError as e:  # another process added it a moment ago
                if "duplicate column" not in str(e):
                    raise

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ProfileDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, m: Measurement) -> None:
        """Append one measurement and commit it at once (an interrupted run keeps it)."""
        self.conn.execute(
            "INSERT INTO measurements(target,key,impl,schedule,versions,status,median_ns,runs_ns,reason,build_s,"
            "description,created,samples_ns) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (m.target, m.key, m.impl, m.schedule, m.versions, m.status, m.median_ns, json.dumps(list(m.runs_ns)),
             m.reason, m.build_s, m.description, time.time(),
             json.dumps([list(x) for x in m.samples_ns]) if m.samples_ns else None))
        self.conn.commit()

    def lookup(self, target: str, key: str, impl: str, schedule: str, versions: str) -> Measurement | None:
        """The measurement that counts for this exact key (see `best`), or None."""
        return self.lookup_many(target, versions, [(key, impl, schedule)]).get((key, impl, schedule))

    def history(self, target: str, versions: str, keys: Iterable[tuple[str, str, str]]
                ) -> dict[tuple[str, str, str], list[Measurement]]:
        """Every measurement of each (key, impl, schedule), oldest first."""
        want = set(keys)
        out: dict[tuple[str, str, str], list[Measurement]] = {}
        for row in self.conn.execute(
                "SELECT target,key,impl,schedule,versions,status,median_ns,runs_ns,reason,build_s,description,"
                "samples_ns FROM measurements WHERE target=? AND versions=? ORDER BY id", (target, versions)):
            k = (row[1], row[2], row[3])
            if k in want:
                out.setdefault(k, []).append(_row(row))
        return out

    def lookup_many(self, target: str, versions: str, keys: Iterable[tuple[str, str, str]]
                    ) -> dict[tuple[str, str, str], Measurement]:
        """The measurement that counts for each (key, impl, schedule) (see `best`)."""
        return {k: best(ms) for k, ms in self.history(target, versions, keys).items()}

    def fastest(self, target: str, keys: Iterable[str], current) -> dict[str, int]:
        """Per kernel key of `keys`: the least median of its successful measurements on `target`,
        over every implementation and schedule (untuned comparisons aside) whose versions are its
        implementation's `current(impl)`."""
        want, out = set(keys), {}
        for key, impl, versions, ns in self.conn.execute(
                "SELECT key,impl,versions,MIN(median_ns) FROM measurements WHERE target=? AND status='ok' AND "
                "schedule!='none' GROUP BY key,impl,versions", (target,)):
            if key in want and versions == current(impl):
                out[key] = min(out.get(key, ns), ns)
        return out

    def _kept(self, table: str, key: str) -> str | None:
        """The text kept under `key` in `table` (estimates or solutions: its second column), or None."""
        row = self.conn.execute(f"SELECT * FROM {table} WHERE key=?", (key,)).fetchone()
        return row[1] if row else None

    def _keep(self, table: str, key: str, text: str) -> None:
        self.conn.execute(f"INSERT OR REPLACE INTO {table} VALUES (?,?,?)", (key, text, time.time()))
        self.conn.commit()

    def solution(self, key: str) -> str | None:
        """A block solution stored under `key` (kernorch.blocks.SolutionStore), or None."""
        return self._kept("solutions", key)

    def add_solution(self, key: str, doc: str) -> None:
        self._keep("solutions", key, doc)

    def estimates(self, key: str) -> dict[tuple[str, str, str], int] | None:
        """The estimates a run kept under `key` (kernorch.pipeline._resumed), or None."""
        text = self._kept("estimates", key)
        return {(k, i, s): int(ns) for k, i, s, ns in json.loads(text)} if text else None

    def keep_estimates(self, key: str, estimates) -> None:
        self._keep("estimates", key, json.dumps([[*i, int(ns)] for i, ns in sorted(estimates.items())]))

    def comparison(self, key: str) -> tuple[float, float, float] | None:
        """Two executables' timing in turns kept under `key` (kernorch.executed.compared), or None."""
        text = self._kept("comparisons", key)
        return tuple(float(x) for x in json.loads(text)) if text else None

    def keep_comparison(self, key: str, values: tuple[float, float, float]) -> None:
        self._keep("comparisons", key, json.dumps([float(x) for x in values]))

    def rows(self) -> Iterator[Measurement]:
        for row in self.conn.execute(
                "SELECT target,key,impl,schedule,versions,status,median_ns,runs_ns,reason,build_s,description,"
                "samples_ns FROM measurements ORDER BY id"):
            yield _row(row)

    def stats(self) -> dict:
        c = self.conn
        total = c.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
        by = c.execute("SELECT target, impl, status, COUNT(*), COUNT(DISTINCT key) FROM measurements "
                       "GROUP BY target, impl, status ORDER BY target, impl, status").fetchall()
        kept = {t: c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("estimates", "solutions", "comparisons")}
        return {"path": str(self.path), "measurements": total, "runs_kept": kept["estimates"],
                "block_solutions": kept["solutions"], "executable_comparisons": kept["comparisons"],
                "size_bytes": self.path.stat().st_size if self.path.exists() else 0,
                "groups": [{"target": t, "impl": i, "status": s, "rows": n, "distinct_keys": k}
                           for t, i, s, n, k in by]}

    def export(self) -> list[dict]:
        return [m.__dict__ | {"runs_ns": list(m.runs_ns)} for m in self.rows()]

    def clear(self, refused_only: bool = False) -> int:
        where = " WHERE status IN ('refused', 'failed')" if refused_only else ""
        n = self.conn.execute("SELECT COUNT(*) FROM measurements" + where).fetchone()[0]
        self.conn.execute("DELETE FROM measurements" + where)
        if not refused_only:  # estimated and solved from costs that are gone; executables of kernels timed again
            self.conn.execute("DELETE FROM solutions")
            self.conn.execute("DELETE FROM estimates")
            self.conn.execute("DELETE FROM comparisons")
        self.conn.commit()
        return n


def best(measurements: list[Measurement]) -> Measurement:
    """The fastest successful measurement (of equal ones the latest: a kernel over a range timed
    twice is stored with its faster times at each length last, see kernorch.measure); without one,
    the latest refusal; without one either, the latest transient failure (status "failed": a
    crashed or timed-out worker, not a verdict)."""
    ok = [m for m in measurements if m.ok]
    if ok:
        return min(reversed(ok), key=lambda m: m.median_ns)
    refused = [m for m in measurements if m.status == "refused"]
    return (refused or measurements)[-1]


def _row(row) -> Measurement:
    return Measurement(row[0], row[1], row[2], row[3], row[4], row[5], row[6],
                       tuple(json.loads(row[7] or "[]")), row[8] or "", row[9] or 0.0, row[10] or "",
                       tuple((_sample(v), int(ns)) for v, ns in json.loads(row[11] or "[]")))


def _sample(v) -> int | tuple[int, ...]:
    """A sample's name in samples_ns (kernorch.dynamic.sample_key): a length, or the values of several symbols."""
    return tuple(int(x) for x in v) if isinstance(v, list) else int(v)
