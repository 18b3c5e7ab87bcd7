"""A third-party control channel: ``sqlite:///ABSOLUTE/PATH.db``.

The ranks of a job share one SQLite database in WAL mode, one key/value table per job (WAL
needs memory shared between the processes: every rank runs on the machine that holds the
file, not over NFS). ``add``, ``compare_set`` and ``append`` read and write in one
``BEGIN IMMEDIATE`` transaction, which takes the write lock first: atomic across processes.
Each thread has its own connection (a sqlite3 connection belongs to the thread that opened
it), waiting up to the channel's timeout for the write lock; ``_get`` polls, backing off
from 1 ms to 50 ms. Registered through the entry point in ``pyproject.toml``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from dataparallel import ChannelClosed, ChannelURL, ConfigError, ControlChannel, ControlError, ControlTimeout

T = TypeVar("T")


class SqliteChannel(ControlChannel):
    scheme = "sqlite"
    URL_FORM = "{scheme}:///ABSOLUTE/PATH.db"
    URL_HOST = False  # a file on this machine: no host in the URL

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        if not url.path or url.path.endswith("/"):
            raise ConfigError(f"{url.shown!r}: no database file given (expected {cls.url_form(url)})")

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        return f"a local file: whoever may read and write {url.path} holds every job's keys; the token is only compared"

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._path = url.path
        self._table = '"' + f"kv/{self.job}".replace('"', '""') + '"'  # a quoted SQL name
        self._local = threading.local()  # .db: this thread's connection
        self._shut = False
        try:
            self._run(self._setup)
        except ControlError:
            self._close()
            raise

    def _setup(self, db: sqlite3.Connection) -> None:
        """Put the database in WAL mode (kept in the file) and create this job's table."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError:  # refused at once while another process switches it
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        db.execute(
            f"CREATE TABLE IF NOT EXISTS {self._table} (key TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID"
        )

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            # isolation_level=None: no implicit transactions, each statement commits by itself.
            db = sqlite3.connect(self._path, timeout=self.timeout, isolation_level=None)
            db.execute("PRAGMA synchronous=NORMAL")  # no fsync per commit; a killed process loses nothing
            self._local.db = db
        return db

    def _run(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """``op`` on this thread's connection: the one place SQLite's errors become the channel's."""
        if self._shut:
            raise ChannelClosed(f"{self!r} is closed")
        try:
            return op(self._connection())
        except sqlite3.Error as err:
            if "database is locked" in str(err):  # the busy timeout expired
                raise ControlTimeout(
                    f"the write lock of {self._path}", self.timeout, "another process holds it"
                ) from None
            raise ChannelClosed(f"sqlite database {self._path}: {err}") from None

    def _atomic(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """``op`` in one transaction that holds the write lock from its first read."""

        def transaction(db: sqlite3.Connection) -> T:
            db.execute("BEGIN IMMEDIATE")
            try:
                result = op(db)
                db.execute("COMMIT")
                return result
            finally:
                if db.in_transaction:  # op raised (or COMMIT failed): undo
                    db.execute("ROLLBACK")

        return self._run(transaction)

    def _read(self, db: sqlite3.Connection, key: str) -> bytes | None:
        row = db.execute(f"SELECT value FROM {self._table} WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def _write(self, db: sqlite3.Connection, key: str, value: bytes) -> None:
        db.execute(f"INSERT OR REPLACE INTO {self._table} (key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------ hooks
    def _set(self, key: str, value: bytes) -> None:
        self._run(lambda db: self._write(db, key, value))

    def _get(self, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        pause = 0.001
        while True:
            value = self._run(lambda db: self._read(db, key))
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def _add(self, key: str, amount: int) -> int:
        def add(db: sqlite3.Connection) -> int:
            current = self._read(db, key)
            value = (0 if current is None else int(current)) + amount  # ValueError: not a number
            self._write(db, key, str(value).encode())
            return value

        return self._atomic(add)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        def compare_set(db: sqlite3.Connection) -> bytes:
            current = self._read(db, key)
            if current is None and expected:
                return expected  # a missing key matches only b"": nothing created
            if current is not None and current != expected:
                return current
            self._write(db, key, desired)
            return desired

        return self._atomic(compare_set)

    def _append(self, key: str, value: bytes) -> None:
        self._atomic(lambda db: self._write(db, key, (self._read(db, key) or b"") + value))

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        query = f"INSERT OR REPLACE INTO {self._table} (key, value) VALUES (?, ?)"
        self._atomic(lambda db: db.executemany(query, items))

    def _delete(self, key: str) -> bool:
        return self._run(lambda db: db.execute(f"DELETE FROM {self._table} WHERE key = ?", (key,)).rowcount > 0)

    def _check(self, keys: Sequence[str]) -> bool:
        query = f"SELECT 1 FROM {self._table} WHERE key = ?"
        return self._run(lambda db: all(db.execute(query, (k,)).fetchone() for k in keys))

    def _num_keys(self) -> int:
        return self._run(lambda db: db.execute(f"SELECT count(*) FROM {self._table}").fetchone()[0])

    def _close(self) -> None:
        # Later calls raise ChannelClosed. This thread's connection closes now, another
        # thread's when that thread ends or the channel is collected.
        self._shut = True
        db = getattr(self._local, "db", None)
        if db is not None:
            self._local.db = None
            db.close()
