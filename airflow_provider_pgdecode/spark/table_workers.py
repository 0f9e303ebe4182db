"""Tables merged side by side in one Spark application (``MergeOptions.table_workers``).

A table's changes are read, profiled and written in one session: a DataFrame belongs to the
session that made it, and Delta's transaction id is a setting of the session, so two tables
written at once in one session would see each other's. With ``table_workers`` = K > 1 the merge
uses K sessions of the same Spark application - clones of the caller's Spark Connect session
(``cloneSession``: its settings come along), or new sessions of a classic application
(``newSession``, the caller's runtime settings copied) - and gives each a share of the tables, in
a thread of its own; Spark runs their jobs at once. The work still comes in two rounds (every
table profiled before any is written), so a refused table stops the run before anything is
written, as with one session. With K = 1 everything runs in the caller's session and thread.

A table whose MERGE source the driver built (:mod:`.arrow_source`) and delta-rs commits
(:mod:`.light_write`) needs no session at all. Those tables are written first, several at once in
threads of this process (:func:`run_without_sessions`; delta-rs runs outside Python's lock), each
given :data:`NO_SPARK` for a session: a write that turns out to need Spark after all (delta-rs
refused the table, a column to add) asks it for something before anything of the table is
written, gets :class:`NeedsSpark`, and the table is written again with the others, in a session.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from airflow_provider_pgdecode.spark.session import active_connect_session, is_connect_session

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")

#: Threads committing tables without a session (:func:`run_without_sessions`). delta-rs's
#: commits of small tables wait on files as much as on a core: measured on two cores, four
#: threads took about 0.57x the time of one for 50 small MERGEs, two threads 0.7x.
DRIVER_WRITERS = 4


class NeedsSpark(Exception):
    """A write given :data:`NO_SPARK` asked it for something: it needs a Spark session, and has
    written nothing of its table yet."""


class _NoSession:
    """Stands for the Spark session of a write that needs none: any use raises :class:`NeedsSpark`."""

    def __getattr__(self, name: str) -> Any:
        raise NeedsSpark(f"the write asked for Spark ({name})")


NO_SPARK: Any = _NoSession()


@contextlib.contextmanager
def table_sessions(spark: Any, workers: int, tables: int) -> Iterator[list[Any]]:
    """``min(workers, tables)`` sessions of ``spark``'s application, ``spark`` first; the others
    are released on exit (a classic application's sessions share its context: never stopped)."""
    count = max(1, min(int(workers), tables))
    sessions = [spark]
    connect = is_connect_session(spark)
    try:
        for _ in range(count - 1):
            sessions.append(spark.cloneSession() if connect else _classic_sibling(spark))
        if count > 1:
            log.info("Merging %d table(s) with %d sessions side by side", tables, count)
        yield sessions
    finally:
        if connect:
            for session in sessions[1:]:
                with contextlib.suppress(Exception):
                    session.stop()


class SessionsOnDemand:
    """The sessions of :func:`table_sessions` for the tables ``names``, opened when a table first
    asks for its own (:meth:`session_of`), after entering ``settings`` (the run's Spark settings,
    also entered alone by :meth:`set_up`); both are left on exit. A run whose tables delta-rs
    writes without a session (:func:`run_without_sessions`) asks Spark for nothing."""

    def __init__(
        self,
        spark: Any,
        workers: int,
        names: Sequence[str],
        settings: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self._spark, self._workers, self._settings = spark, workers, settings
        self._order = {name: i for i, name in enumerate(names)}
        self._stack = contextlib.ExitStack()
        self._sessions: list[Any] = []
        self._set_up = False

    def __enter__(self) -> SessionsOnDemand:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def set_up(self) -> None:
        """Enter the run's Spark settings, once."""
        if not self._set_up:
            self._stack.enter_context(self._settings())
            self._set_up = True

    def session_of(self, name: str) -> Any:
        """Table ``name``'s session (the tables dealt round-robin over the sessions); called from
        one thread, as :func:`run_sharded` does."""
        if not self._sessions:
            self.set_up()
            self._sessions = self._stack.enter_context(table_sessions(self._spark, self._workers, len(self._order)))
        return self._sessions[self._order[name] % len(self._sessions)]


def run_sharded(
    items: Sequence[Item], session_of: Callable[[Item], Any], work: Callable[[Any, Item], Outcome]
) -> list[Outcome]:
    """``work(session, item)`` for every item, each item in its session's thread, the items of one
    session in order; the outcomes in the items' order. A session's thread stops at its first
    error; once every thread has stopped, the error of the earliest item is raised."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for index, item in enumerate(items):
        session = session_of(item)
        groups.setdefault(id(session), (session, []))[1].append(index)
    outcomes: dict[int, Outcome] = {}
    if len(groups) <= 1:
        for index, item in enumerate(items):
            session = session_of(item)
            with active_connect_session(session):
                outcomes[index] = work(session, item)
        return [outcomes[i] for i in range(len(items))]
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def shard(session: Any, indexes: list[int], pool: str) -> None:
        with active_connect_session(session), scheduler_pool(session, pool):
            for index in indexes:
                try:
                    outcome = work(session, items[index])
                except BaseException as error:  # raised in the caller's thread below
                    with lock:
                        errors.append((index, error))
                    return
                with lock:
                    outcomes[index] = outcome

    threads = [
        threading.Thread(target=shard, args=(*group, f"pgdecode-tables-{n}"), name=f"pgdecode-merge-{n}", daemon=True)
        for n, group in enumerate(groups.values())
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise min(errors, key=lambda pair: pair[0])[1]
    return [outcomes[i] for i in range(len(items))]


@contextlib.contextmanager
def scheduler_pool(session: Any, pool: str) -> Iterator[None]:
    """This thread's jobs of a classic ``session`` in Spark's fair-scheduler pool ``pool`` (made
    on first use; ``spark.scheduler.mode`` FAIR, :func:`~.session.delta_spark_conf`): pools share
    the executors fairly, so a table with many tasks does not hold back the workers beside it.
    A Spark Connect client cannot choose a pool: the server pgdecode starts runs its default pool
    FAIR (``fairscheduler.xml``)."""
    context = None if is_connect_session(session) else getattr(session, "sparkContext", None)
    if context is None:
        yield
        return
    context.setLocalProperty(POOL_PROPERTY, pool)
    try:
        yield
    finally:
        context.setLocalProperty(POOL_PROPERTY, None)


#: The local property naming the fair-scheduler pool of a thread's jobs.
POOL_PROPERTY = "spark.scheduler.pool"


def run_without_sessions(
    items: Sequence[Item], work: Callable[[Any, Item], Outcome], workers: int
) -> tuple[list[tuple[Item, Outcome]], list[Item]]:
    """``work(NO_SPARK, item)`` for every item, ``workers`` at a time in threads. Returns the items
    written, each with its outcome, and the items that need a session (:class:`NeedsSpark`), both in
    the items' order. Any other error is raised once every item has been tried (the earliest
    item's): the items after it are still written, as each is its own table."""
    if not items:
        return [], []

    def attempt(item: Item) -> tuple[str, Any]:
        try:
            return "written", work(NO_SPARK, item)
        except NeedsSpark as reason:
            log.debug("a table written on the driver needs a session: %s", reason)
            return "needs_spark", None
        except BaseException as error:  # raised in the caller's thread below
            return "failed", error

    threads = max(1, min(int(workers), len(items)))
    if threads == 1:
        tried = [attempt(item) for item in items]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="pgdecode-driver-write") as pool:
            tried = list(pool.map(attempt, items))
    failed = [outcome for state, outcome in tried if state == "failed"]
    if failed:
        raise failed[0]
    written = [(item, outcome) for item, (state, outcome) in zip(items, tried, strict=True) if state == "written"]
    needs = [item for item, (state, _) in zip(items, tried, strict=True) if state == "needs_spark"]
    return written, needs


def _classic_sibling(spark: Any) -> Any:
    """A new session of a classic application with the caller's runtime settings (static ones,
    shared by the application anyway, cannot be set and are left)."""
    sibling = spark.newSession()
    for key, value in spark.conf.getAll.items():
        with contextlib.suppress(Exception):
            sibling.conf.set(key, value)
    return sibling
