"""Wake-ups from the database instead of polling (LISTEN/NOTIFY, migration 0004).

The database announces every epoch start and end, and every change of a pipeline's state or stop
request, on the pipeline's channel (``arroyo_channel(pipeline_id)``), when the writing transaction
commits. A notification is only a hint to read the tables again; nothing is decided from it.

* :class:`EpochListener`: one LISTEN connection per store and event loop, shared by every trigger of
  a triggerer. The connection's socket is watched by the event loop (``add_reader``), so receiving
  never blocks it; connecting and (UN)LISTEN run in a worker thread. A trigger takes a
  :class:`Subscription`, reads its :meth:`~Subscription.mark` before a tick and, when it waits for
  an epoch to end, :meth:`~Subscription.wait` returns at once if anything was announced since the
  mark (so an end that committed while the tick was in flight is not missed). While the listener is
  down (a server restart), :attr:`Subscription.live` is false and the triggers poll as before; on
  reconnecting it wakes every trigger once, since announcements may have been lost meanwhile.
  A trigger that follows another copy of itself (triggerer HA) also hears the pipeline's epoch
  *starts* (:meth:`~Subscription.follow_starts`): they never wake it, but tell it that the leading copy
  started the epoch it would tick for, so it can skip that tick (a skipped tick decides nothing; a
  pipeline change or a lost connection since its last tick means no skip).
* :class:`EpochWatch`: the same for one pipeline driver, synchronous (``select`` on the socket);
  it hears epoch starts too (their own channel, which triggers do not listen to).

Both are psycopg2 (the store's driver): its connection exposes the socket and ``poll()`` reads
notifications without blocking, which is all a listener needs.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import select
import time
from collections.abc import Callable

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from airflow_arroyo.store._pool import close_quietly
from airflow_arroyo.store._sync import EpochStore

__all__ = ["EpochListener", "EpochWatch", "Subscription", "channel_of"]

log = logging.getLogger(__name__)

RETRY_MIN, RETRY_MAX = 0.1, 2.0  # seconds between attempts to reconnect a listener
STARTS_KEPT = 64  # epoch starts remembered per pipeline heard starting


@functools.lru_cache(maxsize=1 << 16)  # a listener recomputes its channels on every change of its subscriptions
def channel_of(pipeline_id: str, *, starts: bool = False) -> str:
    """The pipeline's NOTIFY channel of epoch ends and pipeline changes, as the database's
    ``arroyo_channel()`` names it; with ``starts``, its channel of epoch starts."""
    name = "arroyo_" + hashlib.md5(pipeline_id.encode(), usedforsecurity=False).hexdigest()
    return name + "_start" if starts else name


def _listen_sql(verb: str, channels: set[str]) -> sql.Composed:
    return sql.SQL("").join(sql.SQL(verb + " {};").format(sql.Identifier(c)) for c in sorted(channels))


class EpochListener:
    """The LISTEN connection of one store on one event loop (get it with :meth:`for_store`)."""

    def __init__(self, store: EpochStore, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.loop = loop
        self.live = False  # LISTENing on a working connection
        self.notifications = 0
        self._conn: PgConnection | None = None
        self._fd = -1  # the connection's socket (fileno() fails once psycopg2 has closed it)
        self._listening: set[str] = set()  # channel names
        self._refs: collections.Counter[str] = collections.Counter()
        self._start_refs: collections.Counter[str] = collections.Counter()  # pipelines whose starts are heard
        self._by_channel: dict[str, tuple[str, bool]] = {}  # channel -> (pipeline id, is its starts channel)
        self._seq: collections.Counter[str] = collections.Counter()
        self._changes: collections.Counter[str] = collections.Counter()  # pipeline changes, lost connections
        # epochs announced started, with this process's time.monotonic() when heard (newest last)
        self._starts: dict[str, collections.deque[tuple[int, float]]] = {}
        self._waiters: dict[str, set[asyncio.Future[bool]]] = {}
        self._sync_task: asyncio.Task[None] | None = None
        self._retry = RETRY_MIN
        self._retry_at = 0.0
        self._closed = False

    @classmethod
    def for_store(cls, store: EpochStore) -> EpochListener:
        loop = asyncio.get_running_loop()
        return store.loop_helper(loop, "listener", lambda: cls(store, loop))

    # ------------------------------------------------------------------ subscriptions

    async def subscribe(self, pipeline_id: str) -> Subscription:
        """Listen to ``pipeline_id``; returns once the LISTEN is in effect (or the listener is down)."""
        self._refs[pipeline_id] += 1
        self._by_channel[channel_of(pipeline_id)] = (pipeline_id, False)
        self._by_channel[channel_of(pipeline_id, starts=True)] = (pipeline_id, True)
        await self._sync()
        return Subscription(self, pipeline_id)

    def _unsubscribe(self, pipeline_id: str) -> None:
        self._refs[pipeline_id] -= 1
        if self._refs[pipeline_id] <= 0:
            del self._refs[pipeline_id]
            self._seq.pop(pipeline_id, None)
            self._changes.pop(pipeline_id, None)
            if not self.loop.is_closed():
                self._kick()  # UNLISTEN, whenever convenient

    def _hear_starts(self, pipeline_id: str, on: bool) -> None:
        """Listen to the pipeline's epoch starts too (``on``), or no longer; takes effect whenever the
        (UN)LISTEN is done: until then starts are simply not heard."""
        if on:
            self._start_refs[pipeline_id] += 1
        else:
            self._start_refs[pipeline_id] -= 1
            if self._start_refs[pipeline_id] <= 0:
                del self._start_refs[pipeline_id]
                self._starts.pop(pipeline_id, None)
        if not self.loop.is_closed():
            self._kick()

    def _wanted(self) -> set[str]:
        return ({channel_of(p) for p in self._refs}
                | {channel_of(p, starts=True) for p in self._start_refs if p in self._refs})

    def _kick(self) -> None:
        if self._closed:
            return
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = self.loop.create_task(self._do_sync())

    async def _sync(self) -> None:
        self._kick()
        if self._sync_task is not None:
            await asyncio.shield(self._sync_task)

    async def _do_sync(self) -> None:
        """Connect if needed and make the LISTENs match the subscriptions (several rounds if they change)."""
        while True:
            if self._conn is None:
                if self.loop.time() < self._retry_at:
                    return
                try:
                    conn = await asyncio.to_thread(self._open)
                except psycopg2.Error as exc:
                    self._broken(exc)
                    return
                if self._closed:
                    close_quietly(conn)
                    return
                self._conn, self._fd, self._listening = conn, conn.fileno(), set()
                self.loop.add_reader(self._fd, self._on_readable)
            want = self._wanted()
            add, drop = want - self._listening, self._listening - want
            if add or drop:
                conn, fd = self._conn, self._fd
                self.loop.remove_reader(fd)  # the worker thread uses the connection now
                try:
                    await asyncio.to_thread(self._execute, conn, add, drop)
                except psycopg2.Error as exc:
                    self._broken(exc)
                    return
                if self._conn is not conn:  # closed meanwhile
                    return
                self.loop.add_reader(fd, self._on_readable)
                self._listening = (self._listening | add) - drop
                self._dispatch()
            if not self.live:
                self.live = True
                self._retry = RETRY_MIN
                log.info("epoch store listener: listening for %s pipelines", len(self._refs))
                self._wake_all()  # announcements may have been lost while we were not listening
            if self._wanted() == self._listening:
                return

    def _open(self) -> PgConnection:
        conn = self.store.connect()
        conn.autocommit = True
        return conn

    @staticmethod
    def _execute(conn: PgConnection, add: set[str], drop: set[str]) -> None:
        with conn.cursor() as cur:
            if add:
                cur.execute(_listen_sql("LISTEN", add))
            if drop:
                cur.execute(_listen_sql("UNLISTEN", drop))

    def _broken(self, exc: BaseException) -> None:
        """The connection failed (or could not be made): poll meanwhile, reconnect with back-off."""
        if self.live:
            log.warning("epoch store listener: lost its connection (%s); triggers poll until it is back",
                        type(exc).__name__)
        self.live = False
        conn, self._conn, self._listening = self._conn, None, set()
        if conn is not None:
            self.loop.remove_reader(self._fd)
            close_quietly(conn)
        self._wake_all()
        if self._closed:
            return
        self._retry_at = self.loop.time() + self._retry
        self.loop.call_later(self._retry, self._kick)
        self._retry = min(self._retry * 2, RETRY_MAX)

    def close(self) -> None:
        """Stop listening (from any thread; the store closes its listeners with it)."""
        if self.loop.is_closed():
            self._close_now(remove_reader=False)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._close_now()
        else:
            try:
                self.loop.call_soon_threadsafe(self._close_now)
            except RuntimeError:  # closed meanwhile
                self._close_now(remove_reader=False)

    def _close_now(self, remove_reader: bool = True) -> None:
        self.live = False
        self._closed = True  # no reconnecting
        conn, self._conn = self._conn, None
        if conn is not None:
            if remove_reader and not self.loop.is_closed():
                self.loop.remove_reader(self._fd)
            close_quietly(conn)
        self._wake_all()  # waiting triggers poll from now on

    # ------------------------------------------------------------------ notifications

    def _on_readable(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.poll()
        except psycopg2.Error as exc:
            self._broken(exc)
            return
        self._dispatch()

    def _dispatch(self) -> None:
        conn = self._conn
        if conn is None or not conn.notifies:
            return
        notifies = list(conn.notifies)
        del conn.notifies[:]
        for n in notifies:
            self.notifications += 1
            pipeline_id, start = self._by_channel.get(n.channel, ("", False))
            if pipeline_id not in self._refs:
                continue
            if start:  # 'epoch <n> triggered': never a wake-up, a hint for a follower (see the module docstring)
                epoch = _announced_epoch(n.payload)
                if epoch is not None and pipeline_id in self._start_refs:
                    heard = self._starts.setdefault(pipeline_id, collections.deque(maxlen=STARTS_KEPT))
                    heard.append((epoch, time.monotonic()))
                continue
            if not n.payload.startswith("epoch "):
                self._changes[pipeline_id] += 1
            self._seq[pipeline_id] += 1
            for waiter in self._waiters.pop(pipeline_id, ()):
                _resolve(waiter, True)

    def _wake_all(self) -> None:
        for pipeline_id in list(self._refs):
            self._seq[pipeline_id] += 1
            self._changes[pipeline_id] += 1  # announcements may have been lost
        for waiters in self._waiters.values():
            for waiter in waiters:
                _resolve(waiter, True)
        self._waiters.clear()

    def mark(self, pipeline_id: str) -> int:
        return self._seq[pipeline_id]

    def changes(self, pipeline_id: str) -> int:
        return self._changes[pipeline_id]

    def starts_after(self, pipeline_id: str, epoch: int, heard_since: float | None = None) -> list[int]:
        return sorted({n for n, at in self._starts.get(pipeline_id, ())
                       if n > epoch and (heard_since is None or at >= heard_since)})

    async def wait(self, pipeline_id: str, since: int, timeout: float) -> bool:
        """True once anything was announced for the pipeline after ``since``; False after ``timeout``."""
        if self._seq[pipeline_id] != since:
            return True
        if timeout <= 0:
            return False
        waiter: asyncio.Future[bool] = self.loop.create_future()
        self._waiters.setdefault(pipeline_id, set()).add(waiter)
        timer = self.loop.call_later(timeout, _resolve, waiter, False)
        try:
            return await waiter
        finally:
            timer.cancel()
            waiters = self._waiters.get(pipeline_id)
            if waiters is not None:
                waiters.discard(waiter)


def _announced_epoch(payload: str) -> int | None:
    """The epoch number of a start announcement (``epoch <n> <state>``), None for anything else."""
    parts = payload.split()
    if len(parts) == 3 and parts[0] == "epoch" and parts[1].isdigit():
        return int(parts[1])
    return None


def _resolve(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


class Subscription:
    """One trigger's view of the listener for its pipeline (see the module docstring)."""

    def __init__(self, listener: EpochListener, pipeline_id: str) -> None:
        self.listener = listener
        self.pipeline_id = pipeline_id
        self._closed = False
        self._starts = False

    @property
    def live(self) -> bool:
        return self.listener.live and not self._closed

    def mark(self) -> int:
        return self.listener.mark(self.pipeline_id)

    async def wait(self, since: int, timeout: float) -> bool:
        return await self.listener.wait(self.pipeline_id, since, timeout)

    def changes(self) -> int:
        """How many announcements other than epoch ends there were (pipeline changes, and every lost
        connection, when announcements may have been lost): compare two readings."""
        return self.listener.changes(self.pipeline_id)

    def follow_starts(self, on: bool) -> None:
        """Hear the pipeline's epoch starts (from when the LISTEN is in effect), or stop hearing them."""
        if on != self._starts and not self._closed:
            self._starts = on
            self.listener._hear_starts(self.pipeline_id, on)

    def starts_after(self, epoch: int, heard_since: float | None = None) -> list[int]:
        """The epochs after ``epoch`` heard starting (the newest ``STARTS_KEPT``), ascending; with
        ``heard_since`` (a ``time.monotonic()``), only those heard from then on."""
        return self.listener.starts_after(self.pipeline_id, epoch, heard_since) if self._starts else []

    def close(self) -> None:
        if not self._closed:
            self.follow_starts(False)
            self._closed = True
            self.listener._unsubscribe(self.pipeline_id)


class EpochWatch:
    """A pipeline driver's wake-up (synchronous): ``wait(t)`` returns True as soon as an epoch of the
    pipeline starts or ends or the pipeline changes, False after ``t`` seconds of silence. While it
    cannot listen (no connection, a server restart) every call returns True after ``t`` seconds, so
    that the caller reads the store as often as it used to poll."""

    def __init__(self, store: EpochStore, pipeline_id: str, *, idle: Callable[[float], object] = time.sleep) -> None:
        self.store = store
        self.pipeline_id = pipeline_id
        self.idle = idle
        self.notifications = 0
        self._conn: PgConnection | None = None
        self._retry_at = 0.0

    @property
    def live(self) -> bool:
        return self._conn is not None

    def _connect(self) -> bool:
        if self._conn is not None:
            return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            conn = self.store.connect()
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(_listen_sql("LISTEN", {channel_of(self.pipeline_id),
                                                   channel_of(self.pipeline_id, starts=True)}))
        except psycopg2.Error as exc:
            log.warning("pipeline=%s: cannot listen for epochs (%s); polling", self.pipeline_id, type(exc).__name__)
            self._retry_at = time.monotonic() + RETRY_MAX
            return False
        self._conn = conn
        return True

    def wait(self, timeout: float) -> bool:
        fresh = self._conn is None
        if not self._connect():
            self.idle(timeout)
            return True
        conn = self._conn
        assert conn is not None
        if fresh:
            return True  # announcements before the LISTEN are lost: read the store now
        try:
            if not conn.notifies:
                ready, _, _ = select.select([conn], [], [], max(timeout, 0.0))
                if ready:
                    conn.poll()
            got = len(conn.notifies)
            del conn.notifies[:]
        except (psycopg2.Error, OSError) as exc:
            log.warning("pipeline=%s: epoch listener lost its connection (%s); reconnecting", self.pipeline_id,
                        type(exc).__name__)
            self.close()
            return True
        self.notifications += got
        return got > 0

    def close(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)
