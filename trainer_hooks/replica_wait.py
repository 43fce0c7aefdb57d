"""Waiting until every rollout replica has loaded a checkpoint version, with a deadline.

Two ways to know, one class each, both with ``wait(version, timeout_s)``:

- :class:`SidecarWaiter` asks each sidecar's ``GET /wait?version=N&timeout=S`` (200 once the
  replica serves step N or newer, 504 with its status otherwise), and wakes the sidecars with
  ``POST /sync`` right after a publication so that polling watchers (NFS) do not add latency.
- :class:`AckFileWaiter` reads ``<checkpoint_path>/acks/*.json`` until ``expected`` replicas
  with a fresh heartbeat report ``loaded_step >= N``.

On timeout both raise :class:`ReplicaSyncTimeout` naming the lagging replicas and what they
last reported. A sidecar that rejected the checkpoint fails the wait at once (it will never
load it). Progress is logged every few seconds; every HTTP call has a timeout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from rollout_service.bounded_http import Answer, request
from rollout_service.bounded_http import client as bounded_client
from rollout_service.checkpoint_format import step_dir_name
from rollout_service.http_auth import bearer_headers
from rollout_service.protocol import ReplicaReport, heartbeat_problem, read_acks

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
WAIT_SLICE_S = 10.0
"""Longest single ``/wait`` call; the loop re-asks until the overall deadline."""
POLL_INTERVAL_S = 0.5


class ReplicaSyncTimeout(RuntimeError):
    """Not every replica loaded a checkpoint version before the deadline."""


class CheckpointRejected(RuntimeError):
    """A replica's sidecar rejected a checkpoint the trainer published."""


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
        return f"{self.name} ({', '.join(parts)})"


class ReplicaWaiter(Protocol):
    """What the publisher needs from a way of waiting for replicas."""

    def notify(self, version: int) -> None: ...

    def wait(self, version: int, timeout_s: float) -> list[ReplicaView]: ...

    def protected_versions(self) -> set[int]: ...


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
        """Wake every sidecar (``POST /sync``); failures only log, the wait reports them."""
        body = {"checkpoint": step_dir_name(version)}
        for url in self.urls:
            try:
                with bounded_client(headers=self._headers) as client:
                    r = request(client, "POST", f"{url}/sync", json=body, timeout_s=5.0)
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
        wait_s = max(0.1, round(slice_s, 1))
        try:
            params: dict[str, Any] = {"version": version, "timeout": wait_s}
            if self.run_id is not None:
                params["run"] = self.run_id
            asked = time.monotonic()
            r = request(client, "GET", f"{url}/wait", params=params, timeout_s=wait_s + 10.0)
        except httpx.HTTPError as exc:
            view.unreachable = f"{type(exc).__name__}: {exc}"
            time.sleep(min(1.0, slice_s))
            return False
        view.unreachable = None
        body = _json_or_none(r)
        if body is not None:
            _update_view(view, body)
        if r.status_code == 200:
            return True
        if r.status_code != 504:
            view.unreachable = f"GET /wait answered HTTP {r.status_code}: {r.text[:200]}"
            time.sleep(min(1.0, slice_s))
            return False
        rejected = ReplicaReport.from_dict(body, replica_id=view.name).rejected if body is not None else {}
        reason = rejected.get(str(version))
        if reason is not None:
            raise CheckpointRejected(
                f"replica {view.name} rejected checkpoint {step_dir_name(version)} ({reason}): "
                f"{view.last_error or 'see the sidecar log'}. The trainer will not wait for a checkpoint the "
                "replica refuses to load: fix the cause (e.g. tensor names or dtype differ from what the "
                "replica serves) and restart training"
            )
        if time.monotonic() - asked < wait_s / 2:  # answered early (not ready, the root not answering...)
            time.sleep(min(0.5, slice_s))  # ask again soon, not in a tight loop
        return False

    def protected_versions(self) -> set[int]:
        """Steps the sidecars last reported as loaded or loading."""
        steps: set[int] = set()
        for view in self._views.values():
            steps.update(s for s in (view.loaded_step, view.loading_step) if s is not None)
        return steps


class AckFileWaiter:
    """Waits until ``expected`` live replicas' ack files report a version."""

    def __init__(self, root: Path, expected: int, *, max_age_s: float) -> None:
        self.root = Path(root)
        self.expected = expected
        self.max_age_s = max_age_s
        self.run_id: str | None = None
        """The publisher's run id: an ack of another run's checkpoint does not count."""

    def notify(self, version: int) -> None:
        """Nothing to wake: sidecars watch the directory."""

    def wait(self, version: int, timeout_s: float) -> list[ReplicaView]:
        started = time.monotonic()
        deadline = started + timeout_s
        next_report = started + PROGRESS_EVERY_S
        while True:
            views = self._views()
            done = [
                v
                for v in views
                if v.loaded_step is not None
                and v.loaded_step >= version
                and (self.run_id is None or v.run_id == self.run_id)
                and v.current is not False
            ]
            if len(done) >= self.expected:
                return views
            now = time.monotonic()
            if now >= deadline:
                raise ReplicaSyncTimeout(
                    f"only {len(done)} of expected_replicas={self.expected} replica(s) acknowledged checkpoint "
                    f"{step_dir_name(version)} within sync_timeout={timeout_s:g} s. {self._situation(views, version)}"
                    " Check the sidecars' logs and their SGLang servers, or raise sync_timeout"
                )
            if now >= next_report:
                log.info(
                    "waiting for replicas to acknowledge %s (%.0f s of %.0f s): %d of %d done; %s",
                    step_dir_name(version),
                    now - started,
                    timeout_s,
                    len(done),
                    self.expected,
                    self._situation(views, version),
                )
                next_report = now + PROGRESS_EVERY_S
            time.sleep(POLL_INTERVAL_S)

    def protected_versions(self) -> set[int]:
        steps: set[int] = set()
        for view in self._views():
            steps.update(s for s in (view.loaded_step, view.loading_step) if s is not None)
        return steps

    def _views(self) -> list[ReplicaView]:
        views = []
        for name, ack in sorted(read_acks(self.root, max_age_s=self.max_age_s).items()):
            view = ReplicaView(name)
            _update_view(view, ack)
            views.append(view)
        return views

    def _situation(self, live: list[ReplicaView], version: int) -> str:
        lagging = [v.describe() for v in live if v.loaded_step is None or v.loaded_step < version]
        dead = self._dead({v.name for v in live})
        text = f"Live replicas: {len(live)}."
        if lagging:
            text += f" Lagging: {'; '.join(lagging)}."
        if dead:
            text += f" Replicas without a fresh heartbeat (dead?): {'; '.join(dead)}."
        if not live and not dead:
            text += f" No ack files exist under {self.root / 'acks'}: are the sidecars watching {self.root}?"
        return text

    def _dead(self, live: set[str]) -> list[str]:
        """The replicas with an ack file but no live heartbeat, each with why (a bad ack never raises)."""
        now = time.time()
        dead = []
        for name, ack in sorted(read_acks(self.root).items()):
            if name not in live:
                why = heartbeat_problem(ack.get("heartbeat"), now=now, max_age_s=self.max_age_s)
                dead.append(f"{name} ({why or 'its heartbeat is fresh again'})")
        return dead


def _json_or_none(response: Answer) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _update_view(view: ReplicaView, body: dict[str, Any]) -> None:
    """Take what the trainer needs from a replica report (``/wait`` body or ack file)."""
    report = ReplicaReport.from_dict(body, replica_id=view.name)
    view.loaded_step, view.loading_step = report.loaded_step, report.loading_step
    view.run_id, view.current = report.run_id, report.loaded_current
    view.healthy = report.sglang_healthy if "sglang_healthy" in body else None
    error = report.last_error
    view.last_error = None if error is None else f"{error.get('reason')}: {error.get('message')}"
