"""The sync loop: find the newest valid checkpoint, load it into SGLang, acknowledge it.

One asyncio task owns all state changes. Watchdog threads, the HTTP API and a
periodic timer only *wake* it; whatever arrived meanwhile collapses into one
scan that picks the newest checkpoint (coalescing). SGLang is health-checked on
every wake-up: when it is down or comes back with different weights than the
sidecar loaded, the sidecar reports not-ready and re-applies the newest valid
checkpoint as soon as SGLang is healthy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint_format import (
    CheckpointError, parse_step_dir_name, step_dir_name, weight_version_for_step,
)
from ..checkpoint_paths import resolve_inside
from ..checkpoint_reader import TensorSpecs, list_checkpoints, read_model_specs, validate_checkpoint
from .acks import write_ack
from .metrics import SidecarMetrics
from .settings import SidecarSettings
from .sglang_client import SGLangClient, SGLangLoadRejected, SGLangUnavailable

log = logging.getLogger(__name__)

# Loads of one step during which SGLang died, before that step is given up on.
MAX_CRASHES_PER_STEP = 2


@dataclass
class SyncRecord:
    """One finished sync, with its phase times in seconds."""

    step: int
    weight_version: str
    path: str
    detect_s: float | None
    validate_s: float
    load_s: float
    total_s: float | None
    finished_at: float


@dataclass
class SidecarState:
    """Everything ``/status`` reports."""

    replica_id: str
    checkpoint_path: str
    sglang_url: str
    watch_mode: str = "inotify"
    loaded_step: int | None = None
    loading_step: int | None = None
    newest_known_step: int | None = None
    sglang_healthy: bool = False
    sglang_weight_version: str | None = None
    ready: bool = False
    last_sync: SyncRecord | None = None
    last_error: dict[str, Any] | None = None
    rejected: dict[int, str] = field(default_factory=dict)
    ack_error: str | None = None
    started_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["loaded_version"] = None if self.loaded_step is None else weight_version_for_step(self.loaded_step)
        data["pending_step"] = (self.newest_known_step if self.newest_known_step is not None
                                and self.newest_known_step != self.loaded_step else None)
        data["rejected"] = {str(k): v for k, v in self.rejected.items()}
        return data


class SyncController:
    """Owns the loop that keeps one SGLang server on the newest valid checkpoint."""

    def __init__(self, settings: SidecarSettings, metrics: SidecarMetrics | None = None,
                 client: SGLangClient | None = None):
        self.settings = settings
        self.root = Path(settings.checkpoint_path)
        self.metrics = metrics or SidecarMetrics()
        self.client = client or SGLangClient(settings.sglang_url, api_key=settings.sglang_api_key,
                                             timeout_s=settings.request_timeout_s,
                                             load_timeout_s=settings.load_timeout_s)
        self.state = SidecarState(replica_id=settings.replica_id,
                                  checkpoint_path=str(self.root), sglang_url=settings.sglang_url,
                                  watch_mode="inotify" if settings.poll_interval_s is None else "polling")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None
        self._detected_at: dict[int, float] = {}
        self._crashes: dict[int, int] = {}
        self._loaded_before: set[int] = set()
        self._reference: TensorSpecs | None = None
        self._last_ack = 0.0
        self._last_deep = 0.0
        self._stopping = False
        self._was_healthy = False

    # --- wake-ups, from any thread -------------------------------------------------------
    def notify(self, why: str = "") -> None:
        """Wake the loop (thread-safe). Called by the watcher, the API and timers."""
        now = time.time()
        step = parse_step_dir_name(why.split(":", 1)[-1]) if why else None
        if step is not None:
            self._detected_at.setdefault(step, now)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def wait_for_step(self, step: int, timeout_s: float) -> bool:
        """Wait until the loaded step is at least ``step``; False on timeout."""
        assert self._changed is not None
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: (self.state.loaded_step or -1) >= step and
                                           self.state.sglang_healthy),
                    timeout=timeout_s)
                return True
            except asyncio.TimeoutError:
                return False

    def request_checkpoint(self, checkpoint: str) -> Path:
        """Confine a client-named checkpoint to the root, check it names a step, and wake the loop."""
        path = resolve_inside(self.root, checkpoint)
        step = parse_step_dir_name(path.name)
        if step is None or path.parent != Path(os.path.realpath(self.root)):
            raise CheckpointError("not_a_checkpoint", f"{checkpoint} is not a step-XXXXXXXX directory"
                                  f" directly under {self.root}")
        if not path.is_dir():
            raise CheckpointError("missing_checkpoint", f"{path} does not exist")
        self.notify(f"api:{path.name}")
        return path

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        log.info("sidecar %s: SGLang %s, checkpoints %s (%s)", self.settings.replica_id,
                 self.settings.sglang_url, self.root, self.state.watch_mode)
        last_scan = 0.0
        while not self._stopping:
            try:
                await self._check_server()
                if self.state.sglang_healthy:
                    now = time.monotonic()
                    await self._sync_newest()
                    last_scan = now
                await self._maybe_ack()
                await self._publish_state()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep serving: report and retry on the next wake-up
                log.exception("sync loop error")
                self._error("loop_error", str(exc))
            timeout = self.settings.health_interval_s
            if time.monotonic() - last_scan > self.settings.rescan_interval_s:
                timeout = 0.0
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(timeout, 0.01))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def stop(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        await self.client.aclose()

    async def _publish_state(self) -> None:
        newest = self._newest_candidate_step()
        self.state.newest_known_step = newest
        self.state.ready = bool(self.state.sglang_healthy and (
            newest is None or self.state.loaded_step == newest))
        self.metrics.ready.set(1 if self.state.ready else 0)
        self.metrics.sglang_up.set(1 if self.state.sglang_healthy else 0)
        self.metrics.loaded_version.set(-1 if self.state.loaded_step is None else self.state.loaded_step)
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    def _newest_candidate_step(self) -> int | None:
        steps = [c.step for c in list_checkpoints(self.root) if c.step not in self.state.rejected]
        return steps[-1] if steps else None

    async def _check_server(self) -> None:
        now = time.monotonic()
        deep = not self._was_healthy or now - self._last_deep >= self.settings.deep_health_interval_s
        view = await self.client.view(deep=deep)
        if deep and view.healthy:
            self._last_deep = now
        was = self._was_healthy
        self.state.sglang_healthy = view.healthy
        self._was_healthy = view.healthy
        if not view.healthy:
            if was:
                log.warning("SGLang at %s stopped answering /health", self.settings.sglang_url)
                self.metrics.sglang_restarts.inc()
                self._error("sglang_down", f"SGLang at {self.settings.sglang_url} is not answering")
            self.state.ready = False
            return
        self.state.sglang_weight_version = view.weight_version
        loaded = self.state.loaded_step
        if loaded is not None and view.weight_version != weight_version_for_step(loaded):
            log.warning("SGLang reports weight version %r but step %d was loaded: it restarted;"
                        " re-applying the newest checkpoint", view.weight_version, loaded)
            if was:
                self.metrics.sglang_restarts.inc()
            self.state.loaded_step = None
        if self.state.loaded_step is None and view.weight_version is not None:
            step = _step_of_version(view.weight_version)
            if step is not None and _same_path(view.model_path, self.root / step_dir_name(step)):
                # A restarted sidecar beside a server that already serves a published step.
                self.state.loaded_step = step
                self._crashes.pop(step, None)
                log.info("SGLang already serves step %d; adopting it without a reload", step)

    async def _sync_newest(self) -> None:
        """Load the newest valid checkpoint that is newer than what is loaded (if any)."""
        for ckpt in reversed(list_checkpoints(self.root)):
            loaded = self.state.loaded_step
            if loaded is not None and ckpt.step <= loaded:
                return
            if ckpt.step in self.state.rejected:
                continue
            if await self._try_load(ckpt.step, ckpt.path):
                return
            if not self.state.sglang_healthy:
                return

    async def _try_load(self, step: int, path: Path) -> bool:
        detected = self._detected_at.pop(step, time.time())
        # Publish-time latencies only mean something the first time a step is loaded.
        published = None if step in self._loaded_before else _published_at(path)
        self.state.loading_step = step
        try:
            t0 = time.perf_counter()
            try:
                report = await asyncio.to_thread(self._validate, path)
            except CheckpointError as exc:
                self._reject(step, exc.reason, str(exc))
                return False
            validate_s = time.perf_counter() - t0
            load_started = time.time()
            if published is not None:
                self.metrics.detection_latency.observe(max(0.0, load_started - published))
            t1 = time.perf_counter()
            version = weight_version_for_step(step)
            try:
                await self.client.load_from_disk(str(report.path), version)
            except SGLangLoadRejected as exc:
                self._reject(step, "sglang_rejected", str(exc))
                return False
            except SGLangUnavailable as exc:
                self._crashes[step] = self._crashes.get(step, 0) + 1
                self.state.sglang_healthy = False
                self.metrics.syncs.labels("failed", "sglang_unavailable").inc()
                if self._crashes[step] >= MAX_CRASHES_PER_STEP:
                    self._reject(step, "sglang_crashed_on_load",
                                 f"SGLang died {self._crashes[step]} times while loading {path}")
                else:
                    self._error("sglang_unavailable", str(exc), step=step)
                return False
            load_s = time.perf_counter() - t1
            view = await self.client.view()
            if view.weight_version != version:
                self.metrics.syncs.labels("failed", "version_not_confirmed").inc()
                self._error("version_not_confirmed", f"after loading {path} SGLang reports weight"
                            f" version {view.weight_version!r}, expected {version!r}", step=step)
                return False
            finished = time.time()
            self.state.loaded_step = step
            self._loaded_before.add(step)
            self.state.sglang_weight_version = version
            self._crashes.pop(step, None)
            self._reference = report.specs
            record = SyncRecord(
                step=step, weight_version=version, path=str(report.path),
                detect_s=None if published is None else max(0.0, detected - published),
                validate_s=validate_s, load_s=load_s,
                total_s=None if published is None else finished - published, finished_at=finished)
            self.state.last_sync = record
            self.metrics.syncs.labels("loaded", "ok").inc()
            for phase in ("detect_s", "validate_s", "load_s", "total_s"):
                value = getattr(record, phase)
                if value is not None:
                    self.metrics.last_sync_seconds.labels(phase[:-2]).set(value)
            log.info("loaded step %d into SGLang: validate %.3f s, load %.3f s%s", step, validate_s,
                     load_s, "" if record.total_s is None else f", publish->serving {record.total_s:.3f} s")
            await self._maybe_ack(force=True)
            await self._publish_state()
            return True
        finally:
            self.state.loading_step = None

    def _validate(self, path: Path):
        reference, allow_cast = self._reference_specs()
        return validate_checkpoint(path, root=self.root, reference=reference,
                                   allow_float_cast=allow_cast,
                                   check_digests=self.settings.check_digests)

    def _reference_specs(self) -> tuple[TensorSpecs | None, bool]:
        """Previously loaded checkpoint (exact), else the served/base model (any float dtype)."""
        if self._reference is not None:
            return self._reference, False
        if self.settings.reference_dir is not None:
            return read_model_specs(self.settings.reference_dir), True
        return None, False

    def _reject(self, step: int, reason: str, message: str) -> None:
        log.error("rejected checkpoint step %d (%s): %s", step, reason, message)
        self.state.rejected[step] = reason
        self.metrics.syncs.labels("rejected", reason).inc()
        self._error(reason, message, step=step)

    def _error(self, reason: str, message: str, step: int | None = None) -> None:
        self.state.last_error = {"reason": reason, "message": message, "step": step, "at": time.time()}

    async def _maybe_ack(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_ack < self.settings.ack_interval_s:
            return
        self._last_ack = now
        loaded = self.state.loaded_step
        payload = {"loaded_step": loaded,
                   "weight_version": None if loaded is None else weight_version_for_step(loaded),
                   "ready": self.state.ready, "sglang_healthy": self.state.sglang_healthy,
                   "loading_step": self.state.loading_step, "sglang_url": self.settings.sglang_url}
        try:
            await asyncio.to_thread(write_ack, self.root, self.settings.replica_id, payload)
            self.state.ack_error = None
        except OSError as exc:
            if self.state.ack_error is None:
                log.error("cannot write the ack file under %s: %s (HTTP acks still work)", self.root, exc)
            self.state.ack_error = str(exc)


def _same_path(a: str | None, b: Path) -> bool:
    """SGLang's model_path moves with each disk update: it names what it loaded last."""
    return bool(a) and os.path.realpath(a) == os.path.realpath(b) and os.path.isdir(b)


def _step_of_version(version: str) -> int | None:
    return int(version) if version.isdigit() else None


def _published_at(path: Path) -> float | None:
    """When the step directory was renamed into place (its ctime changes on rename)."""
    try:
        return path.stat().st_ctime
    except OSError:
        return None
