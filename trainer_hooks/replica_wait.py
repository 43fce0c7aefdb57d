"""Waiting until every rollout replica has loaded a checkpoint version, with a deadline.

Two ways to know, one class each, both with ``wait(version, timeout_s)``:

- :class:`SidecarWaiter` asks each sidecar's ``GET /wait?version=N&timeout=S`` (200 once the
  replica serves step N or newer, 504 with its status otherwise), and wakes the sidecars with
  ``POST /sync`` right after a publication so that polling watchers (NFS) do not add latency.
- :class:`AckFileWaiter` reads ``<checkpoint_path>/acks/*.json`` until ``expected`` replicas
  with a fresh heartbeat report ``loaded_step >= N``. Its reads run on a thread with a deadline
  (:class:`RootLooks`): a hung network root ends the wait on time, with a reason.

On timeout both raise :class:`ReplicaSyncTimeout` naming the lagging replicas and what they
last reported. A sidecar that rejected the checkpoint fails the wait at once (it will never
load it). Progress is logged every few seconds; every HTTP call has a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import httpx

from rollout_service.bounded_http import Answer, request
from rollout_service.bounded_http import client as bounded_client
from rollout_service.checkpoint_format import ACKS_DIR, step_dir_name
from rollout_service.http_auth import bearer_headers
from rollout_service.protocol import (
    MAX_CLOCK_SKEW_S,
    AcksCutShort,
    HeartbeatClock,
    ReplicaReport,
    heartbeat_problem,
    list_acks,
)
from rollout_service.shown_values import shown_text
from rollout_service.sidecar.root_gate import RootUnresponsive, answered_within

log = logging.getLogger(__name__)
T = TypeVar("T")

PROGRESS_EVERY_S = 10.0
WAIT_SLICE_S = 10.0
"""Longest single ``/wait`` call; the loop re-asks until the overall deadline."""
WAIT_ANSWER_GRACE_S = 3.0
"""How long past its own wait a sidecar's ``GET /wait`` may take to answer (it looks at the root
once more, for at most a second): the trainer's wait ends at most this much past sync_timeout."""
NOTIFY_TIMEOUT_S = 5.0
"""How long one ``POST /sync`` (a wake-up) may take."""
MAX_NOTIFY_THREADS = 32
"""Sidecars woken at once (more wait for a free thread)."""
POLL_INTERVAL_S = 0.5
ROOT_LOOK_TIMEOUT_S = 10.0
"""Longest read of ``<root>/acks`` outside a wait (:meth:`AckFileWaiter.protected_versions`)."""
MIN_READ_S = 0.5
"""The least time a wait's read of the acks gets, so that a wait with little time left reads them once."""
ANSWER_GRACE_S = 0.5
"""How long past its deadline a read that stops at it may take to come back (the file it was on)."""


class ReplicaSyncTimeout(RuntimeError):
    """Not every replica loaded a checkpoint version before the deadline."""


class CheckpointRejected(RuntimeError):
    """A replica's sidecar rejected a checkpoint the trainer published."""


class ReplicaFailed(ReplicaSyncTimeout):
    """A replica's sidecar reports an error it cannot recover from (``fatal`` in its status): it
    will load no checkpoint until someone fixes it, so the wait ends at once instead of at its
    deadline."""


@dataclass
class ReplicaView:
    """What the trainer last learned about one replica."""

    name: str
    loaded_step: int | None = None
    loading_step: int | None = None
    healthy: bool | None = None
    last_error: str | None = None
    unreachable: str | None = None
    run_id: str | None = None
    current: bool | None = None
    """False when the replica's served checkpoint is no longer the published one."""
    wait_ended: str | None = None
    """Why the replica's last ``GET /wait`` ended before its step was served other than by its
    timeout (e.g. ``root_unresponsive``: its checkpoint root did not answer), and what to do."""
    rejected: dict[str, str] = field(default_factory=dict)
    """The steps the replica rejected (the newest ones), by step number as text: their reasons."""
    fatal: str | None = None
    """Why the replica cannot load any checkpoint until it is fixed, if so (bounded text)."""

    def describe(self) -> str:
        if self.unreachable:
            return f"{self.name} (unreachable: {self.unreachable})"
        parts = [f"loaded {self.loaded_step if self.loaded_step is not None else 'nothing'}"]
        if self.run_id is not None:
            parts[0] += f" of run {self.run_id[:12]}"
        if self.loading_step is not None:
            parts.append(f"loading {self.loading_step}")
        if self.healthy is False:
            parts.append("SGLang not healthy")
        if self.last_error:
            parts.append(f"last error: {self.last_error}")
        if self.wait_ended:
            parts.append(f"GET /wait: {self.wait_ended}")
        if self.fatal:
            parts.append(f"cannot load any checkpoint: {self.fatal}")
        return f"{self.name} ({', '.join(parts)})"


class ReplicaWaiter(Protocol):
    """What the publisher needs from a way of waiting for replicas."""

    def notify(self, version: int) -> None: ...

    def wait(self, version: int, timeout_s: float) -> list[ReplicaView]: ...

    def protected_versions(self) -> set[int]: ...


def _pause_until(until: float) -> None:
    """A second's pause before asking again, never past ``until`` (the slice of the wait)."""
    time.sleep(max(0.0, min(1.0, until - time.monotonic())))


class SidecarWaiter:
    """Waits on a list of sidecars' ``GET /wait``."""

    def __init__(self, urls: list[str], *, token: str | None = None) -> None:
        if not urls:
            raise ValueError("SidecarWaiter needs at least one sidecar URL, e.g. ['http://127.0.0.1:8100']")
        self.urls = [u.rstrip("/") for u in urls]
        self.run_id: str | None = None
        """The publisher's run id: only a checkpoint of this run counts (set by the publisher)."""
        self._headers = bearer_headers(token)
        self._views: dict[str, ReplicaView] = {u: ReplicaView(u) for u in self.urls}

    def notify(self, version: int) -> None:
        """Wake every sidecar (``POST /sync``), up to :data:`MAX_NOTIFY_THREADS` at once: sidecars
        that do not answer cost :data:`NOTIFY_TIMEOUT_S` together, not each. Failures only log,
        the wait reports them."""
        body = {"checkpoint": step_dir_name(version)}
        with ThreadPoolExecutor(min(len(self.urls), MAX_NOTIFY_THREADS), thread_name_prefix="sidecar-notify") as pool:
            for url in self.urls:
                pool.submit(self._wake, url, body)

    def _wake(self, url: str, body: dict[str, Any]) -> None:
        try:
            with bounded_client(headers=self._headers) as client:
                r = request(client, "POST", f"{url}/sync", json=body, timeout_s=NOTIFY_TIMEOUT_S)
            if r.status_code == 401:
                log.warning(
                    "sidecar %s refused POST /sync (401): set sidecar_token to its --token; it "
                    "still finds the checkpoint by watching the directory",
                    url,
                )
            elif r.status_code >= 400:
                log.debug("sidecar %s answered POST /sync with %d: %s", url, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            log.debug("could not wake sidecar %s: %s", url, exc)

    def wait(self, version: int, timeout_s: float) -> list[ReplicaView]:
        """Block until every sidecar reports ``loaded_step >= version``; return their views."""
        started = time.monotonic()
        deadline = started + timeout_s
        next_report = started + PROGRESS_EVERY_S
        pending = list(self.urls)
        with bounded_client(headers=self._headers) as client:
            while pending:
                for url in list(pending):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    if self._ask(client, url, version, min(WAIT_SLICE_S, remaining)):
                        pending.remove(url)
                now = time.monotonic()
                if not pending:
                    break
                if now >= deadline:
                    lagging = "; ".join(self._views[u].describe() for u in pending)
                    raise ReplicaSyncTimeout(
                        f"{len(pending)} of {len(self.urls)} replica(s) did not load checkpoint "
                        f"{step_dir_name(version)} within sync_timeout={timeout_s:g} s: {lagging}. Check those "
                        "sidecars (GET /status) and their SGLang servers, or raise sync_timeout"
                    )
                if now >= next_report:
                    log.info(
                        "waiting for %d of %d replica(s) to load %s (%.0f s of %.0f s): %s",
                        len(pending),
                        len(self.urls),
                        step_dir_name(version),
                        now - started,
                        timeout_s,
                        "; ".join(self._views[u].describe() for u in pending),
                    )
                    next_report = now + PROGRESS_EVERY_S
        return [self._views[u] for u in self.urls]

    def _ask(self, client: httpx.Client, url: str, version: int, slice_s: float) -> bool:
        view = self._views[url]
        until = time.monotonic() + slice_s
        wait_s = max(0.1, round(slice_s, 1))
        try:
            params: dict[str, Any] = {"version": version, "timeout": wait_s}
            if self.run_id is not None:
                params["run"] = self.run_id
            asked = time.monotonic()
            r = request(client, "GET", f"{url}/wait", params=params, timeout_s=wait_s + WAIT_ANSWER_GRACE_S)
        except httpx.HTTPError as exc:
            view.unreachable = f"{type(exc).__name__}: {exc}"
            _pause_until(until)
            return False
        view.unreachable = view.wait_ended = None
        body = _json_or_none(r)
        if body is not None and r.status_code in (200, 504):  # a /status body (others: an error's only)
            _update_view(view, body)
        if r.status_code == 200:
            unconfirmed = "its body is not a JSON object" if body is None else _unconfirmed(view, version, self.run_id)
            if unconfirmed is None:
                return True
            view.unreachable = f"GET /wait answered 200, but {unconfirmed} (is {url} one of this project's sidecars?)"
            _pause_until(until)
            return False
        if r.status_code != 504:
            view.unreachable = f"GET /wait answered HTTP {r.status_code}: {r.text[:200]}"
            _pause_until(until)
            return False
        if body is not None:
            _raise_if_refused(view, version)
        error = body.get("error") if body is not None else None
        if body is not None and isinstance(error, str) and error != "wait_timeout":
            # Ended early, e.g. root_unresponsive: asked again, and named in progress and timeout messages.
            view.wait_ended = f"{error[:80]}: {shown_text(body.get('detail'), 300)}"
        if time.monotonic() - asked < wait_s / 2:  # answered early (not ready, the root not answering...)
            time.sleep(min(0.5, slice_s))  # ask again soon, not in a tight loop
        return False

    def protected_versions(self) -> set[int]:
        """Steps the sidecars last reported as loaded or loading."""
        steps: set[int] = set()
        for view in self._views.values():
            steps.update(s for s in (view.loaded_step, view.loading_step) if s is not None)
        return steps


class RootLooks:
    """Reads of the checkpoint root on a daemon thread, each given up on after a bound.

    On a network file system whose server stops answering (a hard NFS mount, a frozen sshfs) a
    read blocks in the kernel, and nothing can cancel it; the caller gets
    :class:`~rollout_service.sidecar.root_gate.RootUnresponsive` instead, as the sidecar's reads
    do. While a read given up on is still blocked, no other starts (the next caller waits for it
    within its own bound), so a hung root holds one thread, not one per poll.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._blocked: tuple[threading.Event, float, str] | None = None
        """The read given up on that has not come back: (set once it does, monotonic start, what)."""

    def run(self, fn: Callable[[float], T], deadline: float, what: str) -> T:
        """``fn(deadline)`` on a daemon thread, waited for until ``deadline`` (``time.monotonic()``)
        and :data:`ANSWER_GRACE_S` more (``fn`` should stop at it). Raises ``RootUnresponsive``
        past that; ``fn``'s own exceptions pass through."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._unresponsive("another read of it did not end in time")
        try:
            self._wait_for_blocked(deadline)
            done = threading.Event()

            def tracked() -> T:
                try:
                    return fn(deadline)
                finally:
                    done.set()

            started = time.monotonic()
            bound = max(0.0, deadline - started) + ANSWER_GRACE_S
            answered, value = answered_within(tracked, bound, f"reading {self.root}: {what}")
            if not answered:
                self._blocked = (done, started, what)
                raise self._unresponsive(f"{what} did not come back within {bound:.1f} s")
            return cast(T, value)
        finally:
            self._lock.release()

    def _wait_for_blocked(self, deadline: float) -> None:
        """Wait until ``deadline`` for the read given up on earlier, if any (RootUnresponsive past it)."""
        if self._blocked is None:
            return
        done, started, what = self._blocked
        if not done.wait(max(0.0, deadline - time.monotonic())):
            age = time.monotonic() - started
            raise self._unresponsive(f"an earlier read ({what}) has been blocked in it for {age:.0f} s")
        self._blocked = None

    def _unresponsive(self, why: str) -> RootUnresponsive:
        return RootUnresponsive(
            f"the checkpoint root {self.root} is not answering: {why}. Check its file system on the trainer's"
            f" machine (NFS server, mount: does `ls {self.root / ACKS_DIR}` return?); raise sync_timeout if it"
            " is only slow"
        )


@dataclass
class _AckSnapshot:
    """What one read of the ack files showed."""

    live: list[ReplicaView]
    """Replicas with a fresh heartbeat (or one seen to change: :class:`HeartbeatClock`), by name."""
    dead: list[str]
    """Replicas with an ack file but no fresh heartbeat, each with why."""
    cut_short: str | None
    """Why the read stopped before the end of the folder (see ``list_acks``); None if it did not."""
    recent: list[ReplicaView]
    """The live ones and those whose heartbeat is at most ``MAX_CLOCK_SKEW_S`` older than the
    freshness asks for (a replica whose clock runs behind, not yet seen to change): what they
    serve or load is kept from retention."""


class AckFileWaiter:
    """Waits until ``expected`` live replicas' ack files report a version.

    Every read of ``<root>/acks`` is bounded (:class:`RootLooks`, ``list_acks``): a hung root or
    a folder flooded with stray files ends the wait with :class:`ReplicaSyncTimeout` at its
    deadline, saying why, and :meth:`protected_versions` raises ``RootUnresponsive`` after
    :data:`ROOT_LOOK_TIMEOUT_S` (``AcksCutShort`` when the folder could not be read whole).
    """

    def __init__(self, root: Path, expected: int, *, max_age_s: float) -> None:
        self.root = Path(root)
        self.expected = expected
        self.max_age_s = max_age_s
        self.run_id: str | None = None
        """The publisher's run id: an ack of another run's checkpoint does not count."""
        self._looks = RootLooks(self.root)
        self._clock = HeartbeatClock()

    def notify(self, version: int) -> None:
        """Nothing to wake: sidecars watch the directory."""

    def wait(self, version: int, timeout_s: float) -> list[ReplicaView]:
        """Block until ``expected`` live replicas ack ``version`` (or newer); return the live views.

        Raises :class:`ReplicaSyncTimeout` at the deadline (a read of the acks never outlasts it
        by more than :data:`ANSWER_GRACE_S`, or :data:`MIN_READ_S` for the first one)."""
        started = time.monotonic()
        deadline = started + timeout_s
        next_report = started + PROGRESS_EVERY_S
        warned = False
        while True:
            try:
                snapshot = self._read(max(deadline, time.monotonic() + MIN_READ_S))
            except RootUnresponsive as exc:
                raise ReplicaSyncTimeout(
                    f"could not learn whether replicas acknowledged checkpoint {step_dir_name(version)} within"
                    f" sync_timeout={timeout_s:g} s: {exc}"
                ) from None
            if snapshot.cut_short is not None and not warned:
                log.warning("%s", snapshot.cut_short)
                warned = True
            views = snapshot.live
            done = [v for v in views if self._acked(v, version)]
            if len(done) >= self.expected:
                return views
            # A replica that refused the step (or cannot load any) never acks it: once too few are
            # left that can, the wait ends now, naming one (a spare's refusal alone ends nothing).
            refusing = [v for v in views if not self._acked(v, version) and _refusal(v, version) is not None]
            if refusing and len(views) - len(refusing) < self.expected:
                _raise_if_refused(refusing[0], version)
            now = time.monotonic()
            if now >= deadline:
                raise ReplicaSyncTimeout(
                    f"only {len(done)} of expected_replicas={self.expected} replica(s) acknowledged checkpoint "
                    f"{step_dir_name(version)} within sync_timeout={timeout_s:g} s. "
                    f"{self._situation(snapshot, version)} Check the sidecars' logs and their SGLang servers, or"
                    " raise sync_timeout"
                )
            if now >= next_report:
                log.info(
                    "waiting for replicas to acknowledge %s (%.0f s of %.0f s): %d of %d done; %s",
                    step_dir_name(version),
                    now - started,
                    timeout_s,
                    len(done),
                    self.expected,
                    self._situation(snapshot, version),
                )
                next_report = now + PROGRESS_EVERY_S
            time.sleep(max(0.0, min(POLL_INTERVAL_S, deadline - time.monotonic())))

    def _acked(self, view: ReplicaView, version: int) -> bool:
        """Whether an ack says its replica serves ``version`` or newer of this run, now: a sidecar
        keeps ``loaded_step`` while its SGLang is down (it reloads it when SGLang is back), so an ack
        with ``sglang_healthy`` false serves nothing (as its ``GET /wait`` says); an ack without
        the field (an older sidecar) counts by its step."""
        return (
            view.loaded_step is not None
            and view.loaded_step >= version
            and (self.run_id is None or view.run_id == self.run_id)
            and view.current is not False
            and view.healthy is not False
        )

    def protected_versions(self) -> set[int]:
        """Steps live replicas report as loaded or loading (``RootUnresponsive`` if the root hangs;
        ``AcksCutShort`` when the acks were not all read: a missed replica's step is not known)."""
        snapshot = self._read(time.monotonic() + ROOT_LOOK_TIMEOUT_S)
        if snapshot.cut_short is not None:
            raise AcksCutShort(snapshot.cut_short)
        steps: set[int] = set()
        for view in snapshot.recent:
            steps.update(s for s in (view.loaded_step, view.loading_step) if s is not None)
        return steps

    def _read(self, deadline: float) -> _AckSnapshot:
        """One bounded read of the ack files, until ``deadline`` (``time.monotonic()``)."""
        listing = self._looks.run(lambda until: list_acks(self.root, deadline=until), deadline, "listing the acks")
        now = time.time()
        live, dead, recent = [], [], []
        for name, ack in sorted(listing.acks.items()):
            why = self._clock.problem(name, ack.get("heartbeat"), now=now, max_age_s=self.max_age_s)
            view = ReplicaView(name)
            _update_view(view, ack)
            if why is None:
                live.append(view)
            else:
                dead.append(f"{name} ({why})")
            if (
                why is None
                or heartbeat_problem(ack.get("heartbeat"), now=now, max_age_s=self.max_age_s + MAX_CLOCK_SKEW_S) is None
            ):
                recent.append(view)
        if listing.cut_short is None:
            self._clock.keep_only(listing.acks)
        return _AckSnapshot(live, dead, listing.cut_short, recent)

    def _situation(self, snapshot: _AckSnapshot, version: int) -> str:
        lagging = [
            v.describe() + (f" rejected it: {v.rejected[str(version)]}" if str(version) in v.rejected else "")
            for v in snapshot.live
            if not self._acked(v, version)
        ]
        text = f"Live replicas: {len(snapshot.live)}."
        if lagging:
            text += f" Lagging: {'; '.join(lagging)}."
        if snapshot.dead:
            text += f" Replicas without a fresh heartbeat (dead?): {'; '.join(snapshot.dead)}."
        if snapshot.cut_short is not None:
            text += f" Not every ack was read: {snapshot.cut_short}."
        elif not snapshot.live and not snapshot.dead:
            text += f" No ack files exist under {self.root / ACKS_DIR}: are the sidecars watching {self.root}?"
        return text


def _json_or_none(response: Answer) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _unconfirmed(view: ReplicaView, version: int, run_id: str | None) -> str | None:
    """None when a ``/wait`` 200 body (read into ``view``) says the replica serves ``version`` or
    newer of ``run_id`` (when given), else what it says instead: a 200 alone (a proxy's page,
    another service, a sidecar that loaded something else) acknowledges nothing."""
    if view.loaded_step is None or view.loaded_step < version:
        return f"it reports loaded_step {view.loaded_step}, not {version} or newer"
    if run_id is not None and view.run_id != run_id:
        return f"it serves run {shown_text(view.run_id, 40)}, not this run ({run_id[:40]})"
    if view.current is False:
        return "it reports its loaded checkpoint is no longer the published one"
    return None


def _refusal(view: ReplicaView, version: int) -> str | None:
    """Why the replica will never serve ``version`` (rejected it, or cannot load any), or None."""
    reason = view.rejected.get(str(version))
    if reason is not None:
        return reason
    return view.fatal


def _raise_if_refused(view: ReplicaView, version: int) -> None:
    """Raise when the replica's report (``/wait`` body or ack file) says it will never serve
    ``version``: it rejected the checkpoint (:class:`CheckpointRejected`), or it cannot load any
    (:class:`ReplicaFailed`). The trainer does not wait out ``sync_timeout`` for either."""
    reason = view.rejected.get(str(version))
    if reason is not None:
        raise CheckpointRejected(  # bounded, like every field of a report that reaches a message
            f"replica {view.name} rejected checkpoint {step_dir_name(version)} ({reason[:200]}): "
            f"{view.last_error or 'see the sidecar log'}. The trainer will not wait for a checkpoint the "
            "replica refuses to load: fix the cause (e.g. tensor names or dtype differ from what the "
            "replica serves) and restart training"
        )
    if view.fatal is not None:
        raise ReplicaFailed(
            f"replica {view.name} cannot load any checkpoint ({view.fatal}): fix it and restart that"
            " replica's sidecar (and training, if it stopped); the trainer does not wait out sync_timeout for it"
        )


def _update_view(view: ReplicaView, body: dict[str, Any]) -> None:
    """Take what the trainer needs from a replica report (``/wait`` body or ack file)."""
    report = ReplicaReport.from_dict(body, replica_id=view.name)
    view.rejected = report.rejected
    fatal = report.fatal
    view.fatal = (
        None if fatal is None else f"{shown_text(fatal.get('reason'), 80)}: {shown_text(fatal.get('message'), 300)}"
    )
    view.loaded_step, view.loading_step = report.loaded_step, report.loading_step
    view.run_id, view.current = report.run_id, report.loaded_current
    view.healthy = report.sglang_healthy if "sglang_healthy" in body else None
    error = report.last_error
    # Bounded: it goes into every progress line and timeout message (a report may carry megabytes).
    view.last_error = (
        None if error is None else f"{shown_text(error.get('reason'), 80)}: {shown_text(error.get('message'), 500)}"
    )
