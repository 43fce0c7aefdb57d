"""Bounded looks at the checkpoint root: a hung file system costs answers, never the sidecar.

The root is usually network storage (NFS, sshfs, CephFS). When its server stops answering, a
call that touches it (a listing, a ``stat``, a manifest read, the ack file's write) blocks in
the kernel, and nothing in Python can cancel it. So each such call runs on a thread of its own
and is awaited for at most a bound; past it the caller gets :class:`RootUnresponsive` while the
thread stays blocked. While any call is blocked past its bound, new calls fail at once instead
of piling up threads behind it, and at most :data:`MAX_THREADS` run at any time. The event loop,
SGLang's health checks and the HTTP API go on meanwhile; ``/readyz`` says why the replica is not
ready. The threads are daemons: a blocked one never holds up the process's exit (a
``to_thread`` worker would: asyncio joins its executor at shutdown). The first call that comes
back again (with an answer or an error: the storage answered) ends the condition.

Validations and staging copies are bounded separately (``SyncController.bounded``): they may
rightly read for minutes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_THREADS = 8
"""Looks at the root in flight at once (the sync loop, ``/wait``s, ``POST /sync``); more wait."""


class RootUnresponsive(Exception):
    """The checkpoint root did not answer in time (or an earlier look is still blocked in it)."""

    reason = "root_unresponsive"


class RootGate:
    """Runs blocking calls on the checkpoint root under a time bound (one instance per root)."""

    def __init__(
        self,
        root: Path,
        timeout_s: float,
        on_change: Callable[[str | None], None] | None = None,
        *,
        where: str | None = None,
    ):
        self.root = root
        self.where = where or f"the checkpoint root {root}"
        """What the calls look at, as messages name it (another gate's files are not the root)."""
        self.timeout_s = timeout_s
        self._on_change = on_change
        """Told each new :attr:`problem` (None once the root answers again), on the event loop."""
        self.problem: str | None = None
        """Why the root counts as unresponsive now (None: it answered last time)."""
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[float, float, str]] = {}
        """Calls whose threads have not returned: id -> (monotonic start, bound, what)."""
        self._ids = itertools.count()
        self._slots = asyncio.Semaphore(MAX_THREADS)  # bound to a loop at its first use, not here

    def blocked(self) -> str | None:
        """What an in-flight call that outlived its bound is doing, and for how long; else None."""
        now = time.monotonic()
        with self._lock:
            late = [(now - started, what) for started, bound, what in self._inflight.values() if now - started > bound]
        if not late:
            return None
        age, what = max(late)
        return f"{what} has been blocked for {age:.0f} s"

    async def call(self, fn: Callable[..., T], *args: Any, what: str) -> T:
        """``fn(*args)`` on a daemon thread, awaited for at most the gate's ``timeout_s`` once
        it runs, after at most as long for a free thread. Raises
        :class:`RootUnresponsive` past either, or at once while another call is blocked; ``fn``'s
        own exceptions pass through (the root answered). A call that comes back after its caller
        gave up still counts as an answer."""
        bound = self.timeout_s
        blocked = self.blocked()
        if blocked is not None:
            raise self._unresponsive(f"an earlier look at the root ({blocked}) has not come back")
        slots = self._slots
        await _acquire(slots, bound, what)
        blocked = self.blocked()  # again: a look may have become blocked while this one waited
        if blocked is not None:
            slots.release()
            raise self._unresponsive(f"an earlier look at the root ({blocked}) has not come back")
        key = next(self._ids)
        with self._lock:  # its bound counts from now: waiting for a slot is not the root's delay
            self._inflight[key] = (time.monotonic(), bound, what)

        def tracked() -> T:
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._inflight.pop(key, None)

        try:
            result = in_daemon_thread(tracked, name=f"root: {what}")
        except BaseException:  # no thread (e.g. the process's limit): nothing is in flight
            with self._lock:
                self._inflight.pop(key, None)
            slots.release()
            raise
        result.add_done_callback(lambda _: slots.release())
        try:
            value = await asyncio.wait_for(asyncio.shield(result), timeout=bound)
        except asyncio.TimeoutError:
            result.add_done_callback(self._late_answer)
            raise self._unresponsive(f"{what} did not come back within {bound:g} s") from None
        except asyncio.CancelledError:  # the caller went away; when the thread comes back, that is an answer
            result.add_done_callback(self._late_answer)
            raise
        except StorageTimedOut as exc:  # the storage's own time-out: it does not answer either
            raise self._unresponsive(f"{what} timed out in the storage ({exc})") from None
        except BaseException:  # fn's own error: the storage answered
            self._answered()
            raise
        self._answered()
        return value

    def _unresponsive(self, why: str) -> RootUnresponsive:
        message = (
            f"{self.where} is not answering: {why}. Check its file system (NFS server, mount; raise"
            " --root-timeout if it is only slow); the replica keeps serving what it loaded and picks up"
            " new checkpoints once it answers"
        )
        if self.problem is None:
            log.warning("%s", message)
        self.problem = message
        if self._on_change is not None:
            self._on_change(message)
        return RootUnresponsive(message)

    def _late_answer(self, result: asyncio.Future[Any]) -> None:
        """(On the loop.) A call its caller gave up on came back: the root answers again."""
        _retrieve(result)
        self._answered()

    def _answered(self) -> None:
        """An answer came: the condition ends, unless another call is still blocked past its bound."""
        if self.problem is None or self.blocked() is not None:
            return
        log.warning("the checkpoint root %s answers again", self.root)
        self.problem = None
        if self._on_change is not None:
            self._on_change(None)


async def _acquire(slots: asyncio.Semaphore, bound: float, what: str) -> None:
    """Take a slot within ``bound`` seconds (RootUnresponsive, without marking the root, when all
    are taken that long); a cancelled caller never keeps one."""
    acquire = asyncio.ensure_future(slots.acquire())
    try:
        await asyncio.wait_for(asyncio.shield(acquire), timeout=bound)
    except BaseException as exc:
        if acquire.done() and not acquire.cancelled():
            slots.release()
        else:
            acquire.cancel()
        if isinstance(exc, asyncio.TimeoutError):
            raise RootUnresponsive(
                f"{what} waited {bound:g} s for one of the {MAX_THREADS} looks at the root in flight to end"
            ) from None
        raise


def answered_within(fn: Callable[[], T], timeout_s: float, name: str) -> tuple[bool, T | None]:
    """``(True, fn())`` when ``fn`` (blocking, on the root) returns within ``timeout_s``, else
    ``(False, None)``, leaving it on a daemon thread (for start-up checks, before any event loop).
    ``fn``'s own exceptions pass through."""
    outcome: list[tuple[bool, Any]] = []

    def work() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # re-raised on the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return False, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return True, value


class StorageTimedOut(OSError):
    """The storage's own ``ETIMEDOUT`` (an NFS soft mount, a FUSE backend) from a call run by
    :func:`in_daemon_thread`. Python makes every ``OSError`` with that errno a ``TimeoutError``,
    the class ``asyncio.wait_for`` raises when a bound runs out, so the callers' bounds took the
    storage's error for their own ("did not come back within 10 s" after a millisecond): this is
    an ``OSError`` like the storage's others, and no ``TimeoutError``."""


def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str) -> asyncio.Future[T]:
    """``fn(*args)`` on a new daemon thread; its outcome as a future of the running loop (an
    ``ETIMEDOUT`` from the storage as :class:`StorageTimedOut`).

    Unlike ``asyncio.to_thread`` a call blocked for good (in a hung file system) holds up
    neither the default executor's few workers nor the process's exit."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if result.done():
            return
        if ok:
            result.set_result(value)
        else:
            result.set_exception(value)

    def work() -> None:
        try:
            value: Any = fn(*args)
            ok = True
        except TimeoutError as exc:
            value, ok = exc, False
            if exc.errno is not None:  # the storage's, not a bound's (see StorageTimedOut)
                value = StorageTimedOut(exc.errno, exc.strerror, exc.filename)
                value.__cause__ = exc
        except BaseException as exc:  # handed to the awaiting caller
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: the sidecar is exiting
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return result


def _retrieve(future: asyncio.Future[Any]) -> None:
    """The outcome of a call its caller gave up on: read so asyncio does not log it as lost."""
    if not future.cancelled():
        future.exception()
