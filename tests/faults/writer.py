"""A background writer for the fault tests: inserts, updates, deletes and two-phase transactions.

Prepared transactions only insert rows with fresh ids, so they hold no lock that the writer's
own later statements would wait on; each is committed (or, one in five, rolled back) a few
operations later, often after a cycle has carried it as pending.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg

TABLES = ("fk_accounts", "fk_events")
MAX_PENDING = 8  # prepared transactions open at once (the test cluster allows 20, shared with other tests)

SCHEMA = """
drop table if exists fk_accounts, fk_events;
create table fk_accounts (id bigint primary key, balance numeric(12, 2), note text);
create table fk_events (id bigint primary key, kind text, payload text, at timestamptz);
"""


class Writer(threading.Thread):
    """Changes ``fk_accounts`` and ``fk_events`` until :meth:`stop`; re-raises its error on stop."""

    def __init__(self, dsn: str, seed: int, events: int = 3_000, pause: tuple[float, float] = (0.05, 0.4)) -> None:
        super().__init__(name="faults-writer", daemon=True)
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.events = events
        self.pause = pause
        self._stop_event = threading.Event()
        self.error: BaseException | None = None
        self.next_id = 1
        self.prepared: list[str] = []
        self.gids = 0
        self.counts = {"insert": 0, "update": 0, "delete": 0, "bulk": 0, "prepare": 0, "commit": 0, "rollback": 0}

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute(
                    "insert into fk_events select g, 'k' || (g %% 5), md5(g::text), now() from generate_series(1, %s) g",
                    (self.events,),
                )
                while not self._stop_event.is_set():
                    self.step(conn)
                    time.sleep(self.rng.uniform(*self.pause))
                while self.prepared:
                    self.resolve(conn, self.prepared.pop(0))
        except BaseException as exc:  # handed to the test thread by stop()
            self.error = exc

    def check(self) -> None:
        """Raise the writer's error, if it failed."""
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=120)
        if self.is_alive():
            raise AssertionError("the writer did not stop")
        self.check()

    def _ids(self, n: int) -> list[int]:
        first = self.next_id
        self.next_id += n
        return list(range(first, first + n))

    def step(self, conn: psycopg.Connection[Any]) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.30:
            ids = self._ids(rng.randint(1, 40))
            conn.execute(
                "insert into fk_accounts select g, g * 1.5, repeat(md5(g::text), %s) from unnest(%s::bigint[]) g",
                (rng.choice((1, 2, 100)), ids),
            )
            self.counts["insert"] += 1
        elif roll < 0.50 and self.next_id > 1:
            low = rng.randint(1, self.next_id)
            conn.execute(
                "update fk_accounts set balance = balance + 1, note = note || 'u' where id between %s and %s",
                (low, low + rng.randint(0, 30)),
            )
            self.counts["update"] += 1
        elif roll < 0.62 and self.next_id > 1:
            low = rng.randint(1, self.next_id)
            conn.execute("delete from fk_accounts where id between %s and %s", (low, low + rng.randint(0, 5)))
            self.counts["delete"] += 1
        elif roll < 0.66:
            # A large transaction: gives the extract and the merge something to chew on.
            conn.execute(
                "update fk_events set payload = md5(random()::text), at = now() where id %% 8 = %s",
                (rng.randint(0, 7),),
            )
            self.counts["bulk"] += 1
        elif roll < 0.80:
            with conn.transaction():
                ids = self._ids(rng.randint(1, 10))
                conn.execute(
                    "insert into fk_accounts select g, 0, 'txn' from unnest(%s::bigint[]) g",
                    (ids,),
                )
                conn.execute("update fk_events set kind = 'txn' where id = %s", (rng.randint(1, self.events),))
                conn.execute("delete from fk_events where id = %s", (rng.randint(1, self.events),))
            self.counts["insert"] += 1
        elif roll < 0.88 and len(self.prepared) < MAX_PENDING:
            self.gids += 1
            gid = f"fk_{self.gids}"
            ids = self._ids(rng.randint(1, 10))
            conn.execute("begin")
            conn.execute("insert into fk_accounts select g, -1, %s from unnest(%s::bigint[]) g", (gid, ids))
            conn.execute(
                "insert into fk_events select g + 10000000, 'prepared', %s, now() from unnest(%s::bigint[]) g",
                (gid, ids),
            )
            conn.execute(f"prepare transaction '{gid}'")
            self.prepared.append(gid)
            self.counts["prepare"] += 1
        elif self.prepared:
            self.resolve(conn, self.prepared.pop(0))

    def resolve(self, conn: psycopg.Connection[Any], gid: str) -> None:
        if self.rng.random() < 0.2:
            conn.execute(f"rollback prepared '{gid}'")
            self.counts["rollback"] += 1
        else:
            conn.execute(f"commit prepared '{gid}'")
            self.counts["commit"] += 1
