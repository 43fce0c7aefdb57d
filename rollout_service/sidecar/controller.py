"""The sync loop: find the newest valid checkpoint, load it into SGLang, acknowledge it.

One asyncio task owns all state changes. Watchdog threads, the HTTP API and a
periodic timer only *wake* it; whatever arrived meanwhile collapses into one
scan that picks the newest checkpoint (coalescing). SGLang is health-checked on
every wake-up: when it is down or comes back with different weights than the
sidecar loaded, the sidecar reports not-ready and re-applies the newest valid
checkpoint as soon as SGLang is healthy.

Everything under the root is untrusted (see ``docs/threat-model.md``):

- A checkpoint is checked against the *served model's* tensor names, shapes and dtypes
  from the first load on (learnt from SGLang's ``model_path`` or ``--reference-dir`` and
  kept in the stage), because any checkpoint that makes SGLang's load raise kills it.
- Validation runs in a thread under a deadline; any failure of step N, whatever raised it,
  rejects N with a reason code. A rejection is remembered until the step directory is
  replaced (republished).
- With a stage (the default), SGLang loads a node-local copy whose every byte was checked
  against the manifest's digests (and for NaN/Inf) while copying: no writer can change the
  bytes between the check and SGLang's read.
- The served checkpoint has an identity beyond its step (manifest fingerprint and run id):
  the sidecar serves the newest checkpoint *in the root*, so a republished step is reloaded
  and an emptied root reused by another run is followed, and ``/wait`` answers only for
  the checkpoint SGLang serves.
- Every loop pass, whatever failed, publishes state and heartbeats the ack file; a pass
  that failed backs off.
- Every other look at the root (listings, manifests, the ack file) goes through the root gate
  (``root_gate.py``): a hung network file system makes the replica unready with a reason
  (``root_unresponsive``), never blocks the event loop, the HTTP API or SGLang's health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint_format import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    parse_step_dir_name,
    step_dir_name,
)
from ..checkpoint_paths import resolve_inside
from ..checkpoint_reader import (
    MAX_CHECKPOINT_ENTRIES,
    PublishedCheckpoint,
    TensorSpecs,
    ValidationReport,
    list_checkpoints,
    validate_checkpoint,
)
from ..protocol import MAX_ACK_TEXT, read_ack, step_for_version, version_for_step
from ..shown_values import shown_text
from ..untrusted_files import Deadline
from .acks import AckWriter
from .adapter_sync import AdapterSync, is_adapter_step
from .metrics import SidecarMetrics
from .root_gate import RootGate, RootUnresponsive, in_daemon_thread
from .served_model import adoptable, base_model_dir, find_reference
from .settings import SidecarSettings
from .sglang_client import (
    ServerView,
    SGLangClient,
    SGLangErrorAnswer,
    SGLangLoadRejected,
    SGLangLoadTimedOut,
    SGLangNotReached,
    SGLangUnavailable,
)
from .stage_folder import remove_entry
from .staging import Stage, StagedBuild, StageError
from .state import SidecarState
from .sync_record import SyncRecord, published_at

log = logging.getLogger(__name__)
T = TypeVar("T")

# Loads of one step during which SGLang died, before that step is given up on.
MAX_CRASHES_PER_STEP = 2
MAX_STORAGE_FAULTS_PER_STEP = 2
"""Validations of one step the storage failed (EIO, ESTALE, ETIMEDOUT on its files, the root
answering) before the step is rejected: a blip of a network file system costs no step, a file
that cannot be read at every try does."""
DETECTING_EVENTS = frozenset({"created", "moved", "modified", "api"})
"""Wake-ups (``kind:name``) that can mean a step just landed: their time is its detection time."""
MAX_DETECTED = 256
"""Detection times held (steps seen, not yet tried): names made and removed by anyone who can
write the root are dropped when unlisted, and never hold more than this."""
MAX_BACKOFF_S = 30.0


class SyncController:
    """Owns the loop that keeps one SGLang server on the newest valid checkpoint."""

    def __init__(
        self, settings: SidecarSettings, metrics: SidecarMetrics | None = None, client: SGLangClient | None = None
    ):
        self.settings = settings
        self.root = Path(settings.checkpoint_path)
        self.metrics = metrics or SidecarMetrics()
        self.client = client or SGLangClient(
            settings.sglang_url,
            api_key=settings.sglang_api_key,
            timeout_s=settings.request_timeout_s,
            load_timeout_s=settings.load_timeout_s,
        )
        self.stage: Stage | None = None
        """Opened (created, locked, cleaned) when the loop starts, not when the app is built."""
        self.acks = AckWriter(self.root, settings.replica_id)
        self.adapters = AdapterSync(self, keep=settings.lora_keep)
        """LoRA adapter steps (``kind: "adapter"``) are loaded through it (adapter_sync.py)."""
        self.state = SidecarState(
            replica_id=settings.replica_id,
            checkpoint_path=str(self.root),
            sglang_url=settings.sglang_url,
            watch_mode="inotify" if settings.poll_interval_s is None else "polling",
            stage_dir=None if settings.stage_dir is None else str(settings.stage_dir),
        )
        self.root_gate = RootGate(self.root, settings.root_timeout_s, on_change=self._root_problem)
        """Every look at the root by the loop and the ack writer passes through it, under a time bound."""
        self.wait_gate = RootGate(self.root, settings.root_timeout_s)
        self.model_gate = RootGate(
            self.root,
            settings.root_timeout_s,
            where="the served model's files (its folder, the Hugging Face cache, --reference-dir, or the"
            " checkpoint SGLang serves)",
        )
        """Looks at the served model's files, which may live on another (hung) mount than the root:
        blocked, they must not keep the root's own looks waiting behind them."""
        """``/wait``'s looks (no token needed): a gate of their own, so that clients waiting by the
        dozen on a slow root cannot take the threads the sync loop and the ack heartbeat need (a
        heartbeat that stops makes trainers count this replica dead)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None
        self._detected_at: dict[int, float] = {}
        self._crashes: dict[int, int] = {}
        self._storage_faults: dict[int, int] = {}
        """Validations of each step the storage failed in a row (see :meth:`reject_unless_root`)."""
        self._loaded_before: set[int] = set()
        self._passed_over: set[int] = set()
        """Steps this pass tried before the one it loads that failed without a rejection."""
        self._sglang_refusal: str | None = None
        """Why SGLang's last answer was not usable (a wrong API key, not SGLang's URL), else None."""
        self._below_adapter: int | None = None
        """The newest adapter step this pass tried or passed over as rejected: no older full step
        is loaded under it (it would replace SGLang's base model, and adapters would no longer load)."""
        self._listed_files: set[int] = set()
        """The steps the last listing of the root held as files (named like a step, no folder):
        a trainer's numbering skips them, so they are no publishes."""
        self._adapter_steps: set[int] = set()
        """Listed steps found to be adapter steps when last tried."""
        self._unconfirmed: tuple[int, float] | None = None
        """A step SGLang took but did not confirm (its load timed out, or SGLang stopped answering
        right after it), and until when (monotonic) no other load is sent: SGLang would run it
        after this one, going back. When SGLang reports its version, it finished, not restarted."""
        self._rejected_at: dict[int, tuple[int, ...] | None] = {}
        self._identity_seen: dict[int, tuple[int, ...] | None] = {}
        """Each step's publication identity as seen before its last validation started: a
        rejection stands until it changes (taken before, so a change during validation counts)."""
        self._rescanned_last: int | None = None
        self._sent: tuple[int, str] | None = None
        """The step and source fingerprint this sidecar last asked SGLang to load (at start: what
        this replica's ack said it served): a step folder SGLang serves from the root is adopted
        only as that publication (:func:`adoptable`)."""
        """The rejected step whose files a listing looked at last: the next listing goes on from
        the one below it (see :meth:`_listing`), so that every rejected step gets its turn."""
        self._listing_problem: str | None = None
        """Why the root's last listing failed although the root answered (too_many_entries)."""
        self._root_hung_in_validation = False
        """A look at the root during the running validation did not come back in time."""
        self._straggler: asyncio.Future[Any] | None = None
        """A validation that outlived its deadline (blocked in storage): until it ends, no other
        starts, so two never work in the stage at once."""
        self._named: dict[int, Path] = {}
        """Steps named by POST /sync: found by a direct lookup even when a shared file system's
        cached listing does not show them yet (NFS, sshfs)."""
        self._reference: TensorSpecs | None = None
        self.base_dir: Path | None = None
        """The local base model folder adapters' recorded base values are compared with (None: not known)."""
        self._base_dir_pending = False
        """``base_dir`` was not known when the reference was learnt (SGLang served a full step):
        looked for again once SGLang serves its base model (restarted on it)."""
        self._served_path: str | None = None
        self._last_ack = 0.0
        self._ack_now: asyncio.Event | None = None
        """Set to have the heartbeat write the ack file at once (a load started)."""
        self._ack_lock: asyncio.Lock | None = None
        """One ack write at a time, each with the state as it is when it starts: an older report
        never lands after a newer one."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._last_deep = 0.0
        self._loads_started = 0
        """Load calls started (:meth:`sglang_loading`): a /health asked meanwhile waited on one."""
        self._stopping = False
        self._was_healthy = False
        self._logged_errors: set[str] = set()
        """Loop errors logged with a traceback since the last clean pass (each once)."""

    # --- wake-ups, from any thread -------------------------------------------------------
    def notify(self, why: str = "") -> None:
        """Wake the loop (thread-safe). Called by the watcher, the API and timers."""
        now = time.time()
        kind, _, name = why.partition(":")
        step = parse_step_dir_name(name) if kind in DETECTING_EVENTS else None
        if step is not None and (step in self._detected_at or len(self._detected_at) < MAX_DETECTED):
            self._detected_at.setdefault(step, now)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def report_fatal(self, reason: str, message: str) -> None:
        """Mark the replica as unable to recover by itself (thread-safe); /readyz turns 503."""
        self.state.fatal = {"reason": reason, "message": message, "at": time.time()}
        log.error("replica cannot recover (%s): %s", reason, message)
        self.notify("fatal")

    def loop_ended(self, task: asyncio.Future[None]) -> None:
        """(The loop task's done callback.) A loop that ends other than by :meth:`stop` is a
        bug or a failure it could not survive: say so (log and /readyz) instead of going quiet."""
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        log.error("the sync loop ended unexpectedly", exc_info=exc)
        if self._changed is not None:  # open /waits answer now (the condition sees fatal)
            asyncio.ensure_future(self._wake_waiters(self.state.newest_known_step, ready=False))
        self.report_fatal(
            "sync_loop_ended",
            f"the sync loop ended ({type(exc).__name__}: {str(exc)[:300]}); no checkpoint loads until"
            " the sidecar restarts (see its log)",
        )

    def serves(self, step: int, run_id: str | None = None) -> bool:
        """True when SGLang serves, right now, a checkpoint at least ``step`` of run ``run_id``."""
        s = self.state
        return bool(
            s.sglang_healthy
            and s.loaded_step is not None
            and s.loaded_step >= step
            and s.loaded_current
            and (run_id is None or s.loaded_run_id == run_id)
        )

    async def wait_for_step(
        self, step: int, timeout_s: float, run_id: str | None = None, *, why: dict[str, str] | None = None
    ) -> bool:
        """Wait until SGLang serves ``step`` or newer (of ``run_id`` when given).

        False on timeout, at once when ``step`` itself was rejected (it will never load), and
        when the look at the served step fails (EIO, ESTALE: not confirmed now; asked again).
        ``why``, when given, gets the ``error`` and ``detail`` of a False that is neither a
        rejection nor a fatal error (those the state names): ``wait_timeout``, or the root's part
        when a look at it ended the wait early, so that a 504 says which (see ``GET /wait``).
        """
        assert self._changed is not None
        why = {} if why is None else why
        deadline = time.monotonic() + timeout_s
        while True:
            why.update(
                error="wait_timeout",
                detail=f"step {step} was not served within the wait's {timeout_s:g} s (GET /status says what"
                " the replica serves and loads); ask again or wait longer",
            )
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda: (
                                self.serves(step, run_id) or step in self.state.rejected or self.state.fatal is not None
                            )
                        ),
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                except asyncio.TimeoutError:
                    return False
            if self.state.fatal is not None and not self.serves(step, run_id):
                return False  # nothing loads any more: /status says why (looking again would spin)
            # A look at the root below stops when the wait does (at least 1 s to answer).
            budget = max(1.0, deadline - time.monotonic())
            look = f"/wait's look at step {step}"
            try:
                if not self.serves(step, run_id):
                    # Rejected: unless its directory was replaced since (then wait on for it). Its
                    # folder and manifest only: a file changed in place is the loop's to see (its
                    # listings read rejected steps' entries within one budget), not each request's
                    # (/wait needs no token: a rejected step of 10^4 entries would be read per call).
                    path = self.root / step_dir_name(step)
                    try:
                        identity = await asyncio.wait_for(
                            self.wait_gate.call(_rejection_identity, path, what=look), budget
                        )
                    except OSError:
                        return False  # not read: the rejection stands
                    if self._still_rejected(step, {step: identity}):
                        return False
                    continue
                # Confirm against the root now, not the last pass: the served step may be gone.
                checked = (self.state.loaded_step, self._served_path)
                look = f"/wait's look at the served step {checked[0]}"
                presence = await asyncio.wait_for(
                    self.wait_gate.call(self._loaded_presence, checked[0], what=look),
                    budget,
                )
            except RootUnresponsive as exc:
                why.update(
                    error=RootUnresponsive.reason,
                    detail=f"{look} could not be made: {exc}. Ask again (the trainer does); nothing is"
                    " confirmed while the root does not answer",
                )
                return False
            except asyncio.TimeoutError:
                why.update(
                    error=RootUnresponsive.reason,
                    detail=f"{look} did not come back within {budget:.1f} s (the wait's time left): the checkpoint"
                    f" root {self.root} is slow. Ask again with a longer timeout, and check its file system"
                    " (NFS server, mount)",
                )
                return False
            if presence == "same":
                # Looked at while the loop went on: what was checked must still be what is served
                # (SGLang may have restarted with its start-up weights meanwhile). Else wait on.
                if (self.state.loaded_step, self._served_path) == checked and self.serves(step, run_id):
                    return True
                continue
            if presence == "unknown":
                why.update(
                    error="root_read_failed",
                    detail=f"{look} failed (an I/O error or a stale NFS handle): step {checked[0]} is not"
                    " confirmed now. Ask again (the trainer does); if it persists, check the checkpoint root's"
                    " file system",
                )
                return False  # not confirmed now: the caller asks again
            if (self.state.loaded_step, self._served_path) == checked:  # not a step loaded meanwhile
                self.state.loaded_current = False
            self.notify("wait")

    def readiness(self, staleness: int = 0) -> tuple[bool, str]:
        """Whether the replica is ready *now*, and why not: computed when asked, never cached.

        ``staleness`` (``GET /readyz?staleness=K``): ready also while SGLang serves a step at most
        K steps older than the newest published one, being loaded meanwhile, as a trainer with
        ``max_staleness=K`` takes its rollouts: a Service that routes only to ready replicas then
        keeps them all during a sync, instead of none."""
        s = self.state
        now = time.time()
        fresh = max(3 * self.settings.health_interval_s, 3.0)
        if s.fatal is not None:
            return False, f"{s.fatal['reason']}: {s.fatal['message']}"
        if self.root_gate.problem is not None:
            return False, f"{RootUnresponsive.reason}: {self.root_gate.problem}"
        if self._listing_problem is not None:
            return False, self._listing_problem
        if s.loop_heartbeat is None or (
            s.loading_step is None and now - s.loop_heartbeat > max(5 * self.settings.health_interval_s, 15.0)
        ):
            return False, "the sync loop has not completed a pass recently"
        if s.sglang_seen_mono is None or time.monotonic() - s.sglang_seen_mono > fresh:
            if self._sglang_refusal is not None:
                return False, self._sglang_refusal
            return False, f"SGLang at {self.settings.sglang_url} has not answered recently"
        if not s.ready:
            behind = self._steps_behind()
            if behind is not None and behind <= staleness:
                return True, (
                    f"serving step {s.loaded_step}, {behind} older than the newest ({s.newest_known_step}):"
                    f" within staleness {staleness}"
                )
            if s.loaded_step is None and s.last_error is not None:
                return False, f"{s.last_error['reason']}: {s.last_error['message']}"
            return False, "not serving the newest valid checkpoint yet"
        return True, "serving the newest valid checkpoint"

    def _steps_behind(self) -> int | None:
        """How many publishes the served step is older than the newest known valid one, while
        SGLang answers and serves it as published: the step numbers in between, less those known
        to be no publish (a file named like a step, which a trainer's numbering skips; a rejected
        step); steps deleted by retention still count. None when it serves nothing (or nothing
        newer is known)."""
        s = self.state
        if (
            not s.sglang_healthy
            or s.fatal is not None
            or s.loaded_step is None
            or not s.loaded_current
            or s.newest_known_step is None
            or s.newest_known_step <= s.loaded_step
        ):
            return None
        loaded, newest = s.loaded_step, s.newest_known_step
        between = range(loaded + 1, newest)
        known = (self._listed_files, s.rejected)
        if len(between) <= len(s.rejected) + len(self._listed_files):  # (junk rejected by the million)
            skipped = sum(1 for st in between if any(st in k for k in known))
        else:
            skipped = len({st for k in known for st in k if loaded < st < newest})
        return max(newest - loaded - skipped, 1)

    def request_checkpoint(self, checkpoint: str) -> Path:
        """Confine a client-named checkpoint to the root, check it names a step, and wake the loop.

        Blocking (it looks at the root): the API calls it in a thread, under a timeout. A name
        whose path, as written, leaves the root is refused before any look, so a client cannot
        make the lookup wait on some other (hung) file system."""
        root = os.path.normpath(self.root)
        written = os.path.normpath(os.path.join(root, checkpoint))
        if written != root and not written.startswith(root.rstrip("/") + "/"):
            raise CheckpointError(
                "path_escape",
                f"{checkpoint[:200]!r} is outside the checkpoint root {self.root}; name a step directory"
                " of the root (e.g. step-00000042)",
            )
        path = resolve_inside(self.root, written)
        step = parse_step_dir_name(path.name)
        if step is None or path.parent != Path(os.path.realpath(self.root)):
            raise CheckpointError(
                "not_a_checkpoint",
                f"{checkpoint[:200]!r} is not a step directory"
                f" ('step-' and 8 digits, e.g. step-00000042) directly under {self.root}",
            )
        try:  # (not Path.is_dir, which takes the storage's EIO for "no folder": a 503, not a 400)
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            is_dir = False
        if not is_dir:
            what = "is not a directory" if os.path.lexists(path) else "does not exist"
            raise CheckpointError("missing_checkpoint", f"{path.name} {what} under {self.root}")
        loaded, rejected = self.state.loaded_step, self.state.rejected.get(step)
        # (The loop's own test: it goes back only once the served step is gone from the root.)
        if loaded is not None and step < loaded and self._loaded_presence(loaded) != "gone":
            raise CheckpointError(
                "older_than_served",
                f"{path.name} is older than step {loaded}, which SGLang serves: the sidecar serves the newest"
                " valid step of the root and never goes back while it is published. To serve older weights,"
                " publish them as a new step (or remove the newer steps from the root)",
            )
        if rejected is not None and self._rejected_unchanged(step, path):
            raise CheckpointError(
                "checkpoint_rejected",
                f"{path.name} was rejected ({rejected}; GET /status says why) and is looked at again only"
                " once it changes: publish it again",
            )
        if len(self._named) < 64:
            self._named[step] = self.root / path.name
        self.notify(f"api:{path.name}")
        return path

    def _rejected_unchanged(self, step: int, path: Path) -> bool:
        """(Blocking: on the root.) Whether rejected ``step``'s folder and manifest are as they were
        when it was rejected (a step republished since is looked at anew: not refused)."""
        then = self._rejected_at.get(step)
        try:
            seen = _read_identity(path, files=False)
        except OSError:
            return False
        return _same_publication(seen, then)

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._ack_now = asyncio.Event()
        self._ack_lock = asyncio.Lock()
        log.info(
            "sidecar %s: SGLang %s, checkpoints %s (%s), stage %s",
            self.settings.replica_id,
            self.settings.sglang_url,
            self.root,
            self.state.watch_mode,
            self.state.stage_dir or "off (SGLang reads shared storage directly)",
        )
        try:
            await self.root_gate.call(
                self.acks.clean_up_leftovers,
                self.settings.root_timeout_s / 2,
                what="removing this replica's leftover ack files",
            )
        except (RootUnresponsive, OSError) as exc:
            log.warning("could not clean up leftover ack files: %s", exc)
        try:  # before the first ack replaces it: what this replica served before a restart
            self._sent = _served_in(
                await self.root_gate.call(
                    read_ack, self.root, self.settings.replica_id, what="reading this replica's last ack"
                )
            )
        except RootUnresponsive as exc:
            log.warning("could not read this replica's last ack: %s", exc)
        if self.settings.stage_dir is not None:
            try:
                self.stage = await asyncio.to_thread(
                    Stage,
                    self.settings.stage_dir,
                    fallback=self.settings.stage_fallback,
                    max_bytes=None if self.settings.stage_max_gb is None else int(self.settings.stage_max_gb * 2**30),
                )
            except StageError as exc:
                self.report_fatal("stage_failed", str(exc))
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="sidecar-ack-heartbeat")
        backoff = 0.0
        while not self._stopping:
            failed = False
            for phase in (self._check_server, self._sync_pass):
                try:
                    await phase()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep serving: report, back off, retry
                    failed = True
                    self._loop_error(phase.__name__, exc)
            for always in (self._maybe_ack, self._publish_state):
                try:
                    await always()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    failed = True
                    self._loop_error(always.__name__, exc)
            self.state.loop_heartbeat = time.time()
            if not failed:
                self._logged_errors.clear()
            backoff = min(max(2 * backoff, 0.5), MAX_BACKOFF_S) if failed else 0.0
            timeout = backoff or self.settings.health_interval_s  # (every pass lists the root)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(timeout, 0.01))
            except asyncio.TimeoutError:
                pass
            if backoff:  # a failing pass must not spin on a flood of wake-ups
                await asyncio.sleep(min(backoff, 1.0))
            self._wake.clear()

    async def _heartbeat(self) -> None:
        """Write the ack file every ``ack_interval`` whatever the sync loop is doing (one pass can
        spend minutes validating and loading a step; readers of the ack files would count the
        replica dead meanwhile), and at once when a load starts: its ``loading_step`` keeps the
        trainer's retention off the step being staged."""
        assert self._ack_now is not None
        while not self._stopping:
            now = self._ack_now.is_set()
            self._ack_now.clear()  # before the write: a load that starts during it asks again
            try:
                await self._maybe_ack(force=now)
            except Exception as exc:  # _maybe_ack reports write failures; anything else is a bug: logged
                log.exception("ack heartbeat failed: %s", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ack_now.wait(), timeout=self.settings.ack_interval_s)

    async def stop(self) -> None:
        self._stopping = True
        if self._ack_now is not None:
            self._ack_now.set()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._wake is not None:
            self._wake.set()
        await self.client.aclose()
        if self.stage is not None:
            self.stage.close()

    def _loop_error(self, where: str, exc: Exception) -> None:
        self.state.loop_errors += 1
        if isinstance(exc, RootUnresponsive):  # the gate logged it; no traceback to show
            self._error(RootUnresponsive.reason, str(exc))
            return
        message = f"{where}: {type(exc).__name__}: {exc}"
        if isinstance(exc, StageError):  # the stage's fault, not the step's: tried again after the back-off
            if message not in self._logged_errors and len(self._logged_errors) < 32:
                log.error("cannot stage (backing off): %s", exc)
                self._logged_errors.add(message)
            step = (self.state.last_error or {}).get("step")
            self._error("stage_failed", str(exc), step=step)
            return
        if message not in self._logged_errors and len(self._logged_errors) < 32:
            log.exception("sync loop error in %s (backing off)", where)  # once per distinct error
            self._logged_errors.add(message)
        else:
            log.debug("sync loop error again: %s", message)
        self._error("loop_error", message)

    async def _publish_state(self) -> None:
        if self.stage is not None:  # where it is now: a default /dev/shm stage moves to disk for a large model
            self.state.stage_dir = str(self.stage.path)
        try:
            candidates, identities = await self.root_gate.call(self._listing, what="listing the root")
        except RootUnresponsive:
            if self.root_gate.problem is not None:  # not when all threads were only busy
                await self._wake_waiters(self.state.newest_known_step, ready=False)
            raise
        except CheckpointError as exc:  # the root cannot be listed whole (too_many_entries)
            self._listing_problem = f"{exc.reason}: {exc}"
            self._error(exc.reason, str(exc))
            await self._wake_waiters(self.state.newest_known_step, ready=False)
            return
        self._listing_problem = None
        self._forget_unlisted(candidates)
        self._listed_files = {c.step for c in candidates if not c.is_dir}
        steps = [c.step for c in candidates if not self._still_rejected(c.step, identities)]
        await self._wake_waiters(steps[-1] if steps else None)

    def _root_problem(self, problem: str | None) -> None:
        """(From the root gate, on the loop.) The root stopped answering (a reason) or answers
        again (None: a pass starts at once)."""
        self.state.root_problem = problem
        self.metrics.root_responsive.set(0 if problem else 1)
        if problem is None:
            self.notify("root answers")

    async def _wake_waiters(self, newest: int | None, ready: bool = True) -> None:
        """Set the state derived from the newest known step and wake every ``/wait``
        (``ready=False``: not ready whatever is served, e.g. while the root does not answer)."""
        s = self.state
        s.newest_known_step = newest
        s.ready = bool(
            ready
            and s.sglang_healthy
            and s.fatal is None
            and (newest is None or (s.loaded_step == newest and s.loaded_current))
        )
        self.metrics.ready.set(1 if s.ready else 0)
        self.metrics.sglang_up.set(1 if s.sglang_healthy else 0)
        self.metrics.loaded_version.set(-1 if s.loaded_step is None else s.loaded_step)
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _wake_after_load(self, step: int) -> None:
        """Answer the ``/wait``s as soon as ``step`` is recorded as served, not after the
        housekeeping that follows a load (pruning the stage, the ack file, the root's listing
        on shared storage: 0.1-0.2 s measured); the newest step known is at least ``step``. SGLang
        just answered (the load): a pass longer than the health check's freshness (validating and
        staging a large step) does not leave ``/readyz`` saying SGLang has not answered recently.

        A newer step known from an earlier listing counts only while it is not rejected: the pass
        that loaded ``step`` went newest first, so any newer step it saw was rejected on the way
        (else the replica would stay unready, a valid step served, until the next listing); unless
        it passed over a newer step that failed without a rejection (a hung root cut its check
        short): that one is still to load, so the replica is not ready yet."""
        self.state.saw_sglang()  # it answered the load: a long pass is no silence
        self.state.sglang_healthy = True  # (the pass's watch may have seen it silent before)
        known = self.state.newest_known_step
        if known is not None and known in self.state.rejected and not any(p > step for p in self._passed_over):
            known = None
        await self._wake_waiters(max(step, known or step))

    async def _check_server(self) -> None:
        view, deep = await self._view()
        was = self._was_healthy
        self.state.sglang_healthy = view.healthy
        self._was_healthy = view.healthy
        if not view.healthy:
            self._sglang_silent(was, view.refusal)
            return
        self._sglang_refusal = None
        self.state.saw_sglang()
        self.state.sglang_weight_version = view.weight_version
        loaded = self.state.loaded_step
        unconfirmed = None if self._unconfirmed is None else self._unconfirmed[0]
        if loaded is not None and unconfirmed is not None and view.weight_version == version_for_step(unconfirmed):
            log.info("SGLang finished loading step %d after all; adopting it", unconfirmed)
            self.state.loaded_step = None  # adopted below, without a reload
            self.state.loaded_fingerprint = self.state.loaded_run_id = None
        elif loaded is not None and (
            not await self.adapters.still_served()
            if self.adapters.serving
            else view.weight_version != version_for_step(loaded)
        ):
            self._weights_lost(view.weight_version, loaded)
        if self.state.loaded_step is None and view.weight_version is not None:
            adopted = await self.root_gate.call(
                adoptable, view, self.root, self.stage, self._sent, what="looking for the step SGLang already serves"
            )
            if adopted is not None and self.state.loaded_step is None:  # on the loop: /status sees all or nothing
                step, manifest, served = adopted
                self._set_loaded(step, manifest, str(served))
                self._crashes.pop(step, None)
                self._unconfirmed = None
                if self.state.rejected.get(step) == "sglang_crashed_on_load":  # it finished after all
                    del self.state.rejected[step]
                    self._rejected_at.pop(step, None)
                if self.state.last_error is not None and self.state.last_error.get("step") == step:
                    self.state.last_error = None
                log.info("SGLang already serves step %d (%s); adopting it without a reload", step, served)
                if self.stage is not None:  # copies older than it are done with (a load in flight is not)
                    await asyncio.to_thread(self.stage.prune_before_first_load, str(served))
        if self._reference is None:
            revision = await self._served_revision()
            if revision is not False:
                try:
                    await self.model_gate.call(
                        self._ensure_reference, view, revision, what="reading the served model's tensor list"
                    )
                except RootUnresponsive as exc:
                    self._error("model_unresponsive", str(exc))
        elif self._base_dir_pending and step_for_version(view.weight_version) is None:
            revision = await self._served_revision()
            if revision is not False:
                try:
                    self.base_dir = await self.model_gate.call(
                        base_model_dir,
                        view,
                        self.root,
                        self.stage,
                        self.settings.reference_dir,
                        revision,
                        what="looking for the base model's folder",
                    )
                except RootUnresponsive as exc:
                    self._error("model_unresponsive", str(exc))
                    return
                self._base_dir_pending = False  # (after the look: one that did not answer is asked again)

    async def _view(self, *, loading: bool = False) -> tuple[ServerView, bool]:
        """SGLang's answer, and whether it was a deep one (``/health`` too): deep while SGLang has
        not answered one since it was last silent, and every ``--deep-health-interval``, so that a
        scheduler that hangs behind a live HTTP front is seen (``/model_info`` alone would still
        answer); never while a load call is in flight (``loading``: ``/health`` waits on it)."""
        now = time.monotonic()
        due = not self._was_healthy or now - self._last_deep >= self.settings.deep_health_interval_s
        deep = due and not loading
        view = await self.client.view(deep=deep)
        if deep and view.healthy:
            self._last_deep = now
        return view, deep

    def _sglang_silent(self, was_healthy: bool, refusal: str | None = None) -> None:
        """(On the loop.) SGLang did not answer: nothing is served (``serves`` is False), a load
        in flight is lost with it (or shows as a new version), and the first silence is logged.
        ``refusal``: something answered, but not as SGLang does for the sidecar (a wrong API key,
        a URL that is not SGLang's): logged and reported each time it changes."""
        if refusal is not None and refusal != self._sglang_refusal:
            log.error("%s", refusal)
            self._error("sglang_refused", refusal)
        elif was_healthy:
            log.warning("SGLang at %s stopped answering", self.settings.sglang_url)
            self._error("sglang_down", f"SGLang at {self.settings.sglang_url} is not answering")
        self._sglang_refusal = refusal
        self.state.sglang_healthy = self._was_healthy = False
        self._unconfirmed = None
        self.state.ready = False

    def _weights_lost(self, version: str | None, loaded: int) -> None:
        """(On the loop.) SGLang answers with weights other than step ``loaded``'s: it restarted.
        Nothing is served from now on (``/wait`` and the ack file say so at once), until a step
        is loaded again (the pass may take minutes)."""
        log.warning(
            "SGLang reports weight version %r but step %d was loaded: it restarted; re-applying the newest checkpoint",
            version,
            loaded,
        )
        self.metrics.sglang_restarts.inc()  # counted only when the weights were really lost
        self.state.loaded_step = None
        self.state.loaded_fingerprint = self.state.loaded_run_id = None
        self.state.sglang_weight_version = version
        self._not_serving()

    def _not_serving(self) -> None:
        """(On the loop.) Unready now, and the ack file rewritten at once (not at the next
        heartbeat): a trainer waiting through it must not count this replica meanwhile."""
        self.state.ready = False
        self.metrics.ready.set(0)
        if self._ack_now is not None:
            self._ack_now.set()

    async def _served_revision(self) -> str | None | bool:
        """The Hub revision SGLang was started with (``--revision``: its ``/server_info``), so
        that a Hub id is looked up in the local cache at the snapshot SGLang loaded, not at
        whatever ``main`` points to there now. None when it names none or ``--reference-dir``
        is given; False when SGLang does not answer (the reference waits for the next pass)."""
        if self.settings.reference_dir is not None:
            return None
        try:
            info = await self.client.server_info()
        except SGLangUnavailable:
            return False
        revision = info.get("revision")
        return revision if isinstance(revision, str) and revision and "\0" not in revision else None

    def _ensure_reference(self, view: ServerView, revision: str | None = None) -> None:
        """Learn the served model's tensor specs once (every checkpoint is checked against them)."""
        if self._reference is not None:
            return
        found = find_reference(view, self.root, self.stage, self.settings.reference_dir, revision)
        if found is None:
            self._error(
                "no_reference",
                f"cannot learn the tensor names and shapes of the model SGLang serves"
                f" ({view.model_path!r} is not a local model directory, nor a Hub id in this"
                " machine's Hugging Face cache): pass --reference-dir with that model's directory,"
                " or mount SGLang's model folder or download cache here at the same path (the same"
                " HF_HOME); nothing is loaded until then",
            )
            return
        self._reference, self.state.reference = found
        self.base_dir = base_model_dir(view, self.root, self.stage, self.settings.reference_dir, revision)
        self._base_dir_pending = self.base_dir is None and step_for_version(view.weight_version) is not None
        if self.stage is not None:
            self.stage.save_reference(*found)
            self.stage.prune_before_first_load(view.model_path)
        log.info(
            "checking checkpoints against %d tensors of the served model (%s)",
            len(self._reference),
            self.state.reference,
        )
        if self.state.last_error and self.state.last_error.get("reason") == "no_reference":
            self.state.last_error = None

    async def _sync_pass(self) -> None:
        staged_ok = self.settings.stage_dir is None or self.stage is not None
        if self._unconfirmed is not None:
            if time.monotonic() < self._unconfirmed[1]:
                return  # SGLang may still be loading that step: a load sent now would run after it
            self._unconfirmed = None
        if self.state.sglang_healthy and self._reference is not None and self.state.fatal is None and staged_ok:
            done = asyncio.Event()
            watch = asyncio.create_task(self._watch_sglang_during_pass(done), name="sidecar-sglang-watch")
            try:
                await self._sync_newest()
            finally:
                # Told by the event, not only cancelled: in Python 3.11 ``asyncio.wait_for`` (under
                # every HTTP call) drops a cancellation that arrives as its call completes, and the
                # pass would then wait for a watch that never ends.
                done.set()
                watch.cancel()
                await asyncio.wait({watch})
                if not watch.cancelled() and watch.exception() is not None:
                    log.warning("watching SGLang during a pass failed: %r", watch.exception())

    async def _watch_sglang_during_pass(self, done: asyncio.Event) -> None:
        """While a pass validates and stages a step (minutes for a large or junk step), keep
        ``sglang_seen_at`` fresh from SGLang's answers every ``health_interval``: ``/readyz``
        must not call a serving replica unready because the loop is busy (anyone who can write
        the root could otherwise take every replica out of service for ``--validate-timeout``).
        It asks as the loop's own check does (:meth:`_view`: ``/health`` too at its interval,
        but not during the load call), and what it sees counts the same: an SGLang that stops
        answering, or whose scheduler hangs, serves nothing (``/wait`` and the ack file stop
        confirming the step it held, and ``serve``'s hang check counts from its last answer: a
        pass can last ``--validate-timeout``), and one that answers with weights this replica
        neither serves nor loads (it restarted on its start-up weights) lost the served step
        (the pass after this one reloads)."""
        while not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self.settings.health_interval_s)
            if done.is_set():
                return
            loads = self._loads_started
            view, deep = await self._view(loading=self.state.sglang_loading_step is not None)
            if done.is_set():
                return
            s = self.state
            if not view.healthy and deep and (s.sglang_loading_step is not None or self._loads_started != loads):
                continue  # the load call started while /health was asked: /health waited on it
            if not view.healthy:
                self._sglang_silent(s.sglang_healthy, view.refusal)
                self._not_serving()  # (and the ack file says so at once)
                continue
            if deep:
                self._was_healthy = True
            self._sglang_refusal = None
            back = not s.sglang_healthy
            s.sglang_healthy = True
            expected = {version_for_step(step) for step in (s.loaded_step, s.loading_step) if step is not None}
            if self.adapters.serving or s.loaded_step is None or view.weight_version in expected:
                s.saw_sglang()
                if back:  # it answers again on the same weights: ready as before, the /waits told
                    log.info("SGLang at %s answers again", self.settings.sglang_url)
                    await self._wake_waiters(s.newest_known_step)
                    if self._ack_now is not None:
                        self._ack_now.set()
            else:
                self._weights_lost(view.weight_version, s.loaded_step)

    async def _sync_newest(self) -> None:
        """Serve the newest valid checkpoint in the root (if SGLang does not already)."""
        try:
            checkpoints, identities, presence = await self.root_gate.call(self._scan, what="listing the root")
        except CheckpointError as exc:
            self._error(exc.reason, str(exc))
            return  # unready with the reason: see _publish_state
        self._forget_unlisted(checkpoints)
        self._listed_files = {c.step for c in checkpoints if not c.is_dir}
        if presence != "unknown":  # (a look that failed says nothing: as the last pass found)
            self.state.loaded_current = presence == "same"
        loaded = self.state.loaded_step
        self._passed_over = set()
        self._below_adapter = None
        for ckpt in reversed(checkpoints):
            if loaded is not None and ckpt.step == loaded and presence in ("same", "unknown"):
                return
            if loaded is not None and ckpt.step < loaded and presence != "gone":
                return  # never go back while the served step is still published
            if self._still_rejected(ckpt.step, identities):
                if ckpt.step in self._adapter_steps:
                    self._below_adapter = self._below_adapter or ckpt.step
                continue
            outcome = await self._try_load(ckpt)
            if outcome is None or outcome:
                return
            if ckpt.step not in self.state.rejected:
                self._passed_over.add(ckpt.step)  # failed for now, not rejected: still to load
            if (
                not self.state.sglang_healthy
                or self._validation_stuck()
                or self.root_gate.problem is not None
                or ckpt.step in self._storage_faults
            ):
                return  # an older step would wait on the same storage (or SGLang): end the pass

    def _scan(self) -> tuple[list[PublishedCheckpoint], dict[int, tuple[int, ...] | None], str]:
        """(Blocking: on the root.) :meth:`_listing` and the served step's presence."""
        return *self._listing(), self._loaded_presence()

    def _listing(self) -> tuple[list[PublishedCheckpoint], dict[int, tuple[int, ...] | None]]:
        """(Blocking: on the root.) The candidates, and the publication identity of each one that
        was rejected (the loop decides from it whether the rejection still stands).

        Each rejected step's folder and manifest are looked at every time (two ``lstat``: a
        republished step, or a folder whose entries changed, is looked at anew at once). Its
        files' part (a ``stat`` of each entry: a file completed in place changes nothing else)
        is read only while the folder and manifest are as they were at the rejection, and for
        at most :data:`RESCAN_ENTRIES` entries per listing, all steps together, taking turns
        (newest first): junk steps rejected by the hundred, each with thousands of files, would
        otherwise make every listing, run twice a pass under ``--root-timeout``, read them all
        again. A step whose files were not read this time keeps its rejection until its turn."""
        candidates = self._candidates()
        rejected = dict(self.state.rejected)
        identities: dict[int, tuple[int, ...] | None] = {}
        to_rescan: list[PublishedCheckpoint] = []
        for c in candidates:
            if c.step not in rejected:
                continue
            try:
                shallow: tuple[int, ...] | None = _read_identity(c.path, files=False)
            except FileNotFoundError:
                shallow = None  # gone, or half replaced: looked at anew
            except OSError:
                continue  # not read (EIO, ESTALE...): the rejection stands, its crash count too
            identities[c.step] = shallow
            then = self._rejected_at.get(c.step)
            if (
                shallow is not None
                and rejected[c.step] not in FOLDER_REASONS
                and then is not None
                and len(then) > len(shallow)
                and then[: len(shallow)] == shallow
            ):
                to_rescan.append(c)  # as it was: only its files can tell
        to_rescan.reverse()  # newest first, from the one after the step looked at last, around
        last = self._rescanned_last
        if last is not None:
            to_rescan = [c for c in to_rescan if c.step < last] + [c for c in to_rescan if c.step >= last]
        budget = RESCAN_ENTRIES
        for c in to_rescan:
            if budget <= 0:
                break
            first = budget == RESCAN_ENTRIES  # (read whole, however many it holds: none waits forever)
            try:
                files, looked = _files_identity(c.path, limit=MAX_CHECKPOINT_ENTRIES if first else budget)
            except FileNotFoundError:
                files, looked = None, 0
                identities[c.step] = None  # gone, or half replaced: looked at anew
            except OSError:
                files, looked = None, 0  # not read (EIO, ESTALE...): it stands until its next turn
            budget -= max(looked, 1)
            if files is None and looked:
                break  # more entries than this listing has left to look at: first in turn next time
            self._rescanned_last = c.step
            shallow = identities[c.step]
            if files is not None and shallow is not None:
                identities[c.step] = (*shallow, files)
        return candidates, identities

    def _candidates(self) -> list[PublishedCheckpoint]:
        """The root's listing plus steps named through the API that a direct lookup finds."""
        found = {c.step: c for c in list_checkpoints(self.root)}
        for step, path in list(self._named.items()):
            if step in found or (self.state.loaded_step is not None and step < self.state.loaded_step):
                self._named.pop(step, None)
            elif _is_folder(path):
                found[step] = PublishedCheckpoint(step=step, path=path)
            else:
                self._named.pop(step, None)
        return [found[k] for k in sorted(found)]

    def _loaded_presence(self, checked: int | None = None) -> str:
        """``same``, ``changed`` (republished), ``gone`` or ``unknown`` (a look that failed:
        EIO, a stale NFS handle; the step is looked at again at the next pass, not reloaded),
        for the served checkpoint.

        ``checked``: the served step a caller checked before this look (``/wait``). The look runs
        on a thread while the loop goes on: when the sidecar serves another step, or nothing
        (SGLang restarted), by then, that step is ``gone``, never ``same``. Without it (the
        loop's own scan), nothing served is ``same``: there is nothing to reload."""
        step = self.state.loaded_step
        if checked is not None and step != checked:
            return "gone"
        if step is None:
            return "same"
        fingerprint = self.state.loaded_fingerprint
        path = self.root / step_dir_name(step)
        try:
            os.lstat(path)  # a direct lookup: a stale cached listing cannot make it vanish
        except FileNotFoundError:
            return "gone"
        except OSError:
            return "unknown"
        try:
            manifest = Manifest.load(path, root=self.root)
        except CheckpointError as exc:
            if exc.reason == "missing_manifest":
                return "gone"
            return "unknown" if exc.reason == "unreadable" else "changed"
        if checked is not None and self.state.loaded_step != checked:
            return "gone"  # unloaded while this look ran
        return "same" if manifest.fingerprint() == fingerprint else "changed"

    def _forget_unlisted(self, listed: list[PublishedCheckpoint]) -> None:
        """(On the loop.) Rejections of steps the root no longer holds end: junk that was
        dropped there and removed leaves nothing behind (a step that comes back is looked at
        anew)."""
        steps = {c.step for c in listed}
        self._adapter_steps &= steps
        loaded, now = self.state.loaded_step, time.time()
        for step, seen in list(self._detected_at.items()):
            # (Unlisted for a minute: an event may come before a listing shows its step.)
            if (loaded is not None and step <= loaded) or (step not in steps and now - seen > 60.0):
                self._detected_at.pop(step, None)
        for step in [s for s in self._storage_faults if s not in steps]:
            self._storage_faults.pop(step, None)
        for step in [s for s in self.state.rejected if s not in steps]:
            self.state.rejected.pop(step, None)
            self._rejected_at.pop(step, None)
            self._crashes.pop(step, None)
            self._identity_seen.pop(step, None)
            self._detected_at.pop(step, None)

    def _still_rejected(self, step: int, identities: dict[int, tuple[int, ...] | None]) -> bool:
        """(On the loop.) ``step`` was rejected and its publication identity, just read (in
        ``identities``; a step not there was not read: it stays rejected), shows it was not
        replaced since; a replaced one is looked at anew."""
        if step not in self.state.rejected:
            return False
        if step not in identities:
            return True
        seen, then = identities[step], self._rejected_at.get(step)
        if _same_publication(seen, then):
            return True
        self.state.rejected.pop(step, None)
        self._rejected_at.pop(step, None)
        self._crashes.pop(step, None)
        return False

    async def _try_load(self, ckpt: PublishedCheckpoint) -> bool | None:
        """Validate, stage and load ``ckpt``. True: SGLang serves it; False: not loaded, and an
        older step may be tried; None: not loaded, and the pass ends (SGLang took the step but
        what it serves now is not confirmed: loading an older step would go back)."""
        step, path = ckpt.step, ckpt.path
        adapter, published, self._identity_seen[step] = await self.root_gate.call(
            self._look_before_load, ckpt, what=f"reading {path.name}'s manifest"
        )
        if adapter:
            self._adapter_steps.add(step)
            self._below_adapter = self._below_adapter or step
            return await self.adapters.try_load(ckpt, published)
        self._adapter_steps.discard(step)
        if self._below_adapter is not None:
            # A full step replaces SGLang's base model, and no adapter loads after that until SGLang
            # restarts: the newer adapter step (not loaded this pass) is waited for instead.
            log.debug("not loading %s: the newer adapter step %d was not loaded", path.name, self._below_adapter)
            return None
        detected = self._detected_at.pop(step, time.time())
        self.loading(step)
        try:
            t0 = time.perf_counter()
            budget = self.settings.validate_timeout_s
            try:
                prepared = await self.bounded(self._prepare, path, name=path.name, step=step)
                if prepared is None:
                    return False
                report, built = prepared
            except asyncio.TimeoutError:
                await self.reject_unless_root(
                    ckpt,
                    "validation_timeout",
                    f"validating {path.name} did not finish within {budget:g} s (a file"
                    " that blocks or storage that hangs); raise --validate-timeout if"
                    " the storage is just slow",
                )
                return False
            except CheckpointError as exc:
                await self.reject_unless_root(ckpt, exc.reason, str(exc), storage=isinstance(exc, OSError))
                return False
            except StageError as exc:
                self.metrics.syncs.labels("failed", "stage_failed").inc()
                self._error("stage_failed", str(exc), step=step)
                raise
            except Exception as exc:  # whatever broke while reading step N rejects step N
                await self.reject_unless_root(
                    ckpt,
                    "unreadable",
                    f"{path.name} could not be validated: {type(exc).__name__}: {str(exc)[:300]}",
                    storage=isinstance(exc, OSError),
                )
                return False
            validate_s = time.perf_counter() - t0
            version = version_for_step(step)
            if not self.state.sglang_healthy:  # silent since the pass began (its watch): nothing sent
                self._error(
                    "sglang_unavailable",
                    f"SGLang stopped answering while {path.name} was validated; it is loaded once SGLang answers",
                    step=step,
                )
                return False
            self._sent = (step, report.manifest.source_fingerprint())
            t1, load_started_at = time.perf_counter(), time.time()
            try:
                with self.sglang_loading(step):
                    await self.client.load_from_disk(str(report.path), version)
            except SGLangLoadRejected as exc:
                self._reject(ckpt, "sglang_rejected", str(exc))
                await self._discard_copy(built)  # SGLang is done with it
                return False
            except SGLangLoadTimedOut as exc:
                # SGLang may still be loading it and serve it once done: the pass ends (an older
                # step sent now would be loaded after it, going back), the copy stays, and the
                # step counts as a crash (a load stuck for good is not sent forever). If SGLang
                # does finish it, the step is adopted and its rejection, if any, lifted.
                self.died_during_load(ckpt, exc)
                self._unconfirmed = (step, time.monotonic() + self.settings.load_timeout_s)
                return None
            except SGLangUnavailable as exc:
                # Kept: the next try of this step (after a restart) finds it staged.
                self.died_during_load(ckpt, exc)
                return False
            load_s = time.perf_counter() - t1
            view = await self.client.view()
            if not view.healthy:
                # SGLang took the step, then stopped answering: it died of it, or is busy. Its state
                # is unknown: the pass ends (an older step must not be loaded over this one),
                # the copy stays (SGLang may serve it) and the next pass looks again.
                self.died_during_load(
                    ckpt, SGLangUnavailable(f"SGLang stopped answering right after it loaded {path.name}")
                )
                self._unconfirmed = (step, time.monotonic())
                return None
            if view.weight_version != version:
                self.metrics.syncs.labels("failed", "version_not_confirmed").inc()
                self._error(
                    "version_not_confirmed",
                    f"after loading {path.name} SGLang reports weight"
                    f" version {view.weight_version!r}, expected {version!r}",
                    step=step,
                )
                await self._discard_copy(built)
                return None  # another client changes SGLang's weights: no older step over it
            record = SyncRecord.ended_now(
                published=published,
                created_at=report.manifest.created_at,
                detected=detected,
                validate_s=validate_s,
                load_s=load_s,
                load_started_at=load_started_at,
                step=step,
                weight_version=version,
                path=str(report.path),
                run_id=report.manifest.run_id,
                staged=self.stage is not None,
                kind=built.kind if built is not None else report.manifest.kind,
                bytes_read=built.bytes_read if built is not None else None,
                apply_s=built.apply_s if built is not None else None,
                chain_length=built.chain_length if built is not None else 0,
            )
            self._record_sync(report.manifest, record)
            self.adapters.forget_serving()
            self.state.sglang_weight_version = version
            await self._wake_after_load(step)
            if self.stage is not None:
                await asyncio.to_thread(self.stage.prune, {report.path})
                self.state.stage_bytes = await asyncio.to_thread(self.stage.usage_bytes)
                self.metrics.stage_bytes.set(self.state.stage_bytes)
            log.info(
                "loaded step %d (%s%s) into SGLang: validate%s %.3f s, load %.3f s%s",
                step,
                record.kind,
                f", {record.bytes_read / 1e6:.1f} MB read" if record.bytes_read is not None else "",
                "+stage" if self.stage is not None else "",
                validate_s,
                load_s,
                "" if record.total_s is None else f", publish->serving {record.total_s:.3f} s",
            )
            await self._maybe_ack(force=True)
            await self._publish_state()
            return True
        finally:
            self.state.loading_step = None

    @contextlib.contextmanager
    def sglang_loading(self, step: int) -> Iterator[None]:
        """While SGLang runs ``step``'s load call (``/status``'s ``sglang_loading_step``): the
        liveness probe counts SGLang alive then, not while the step is validated or staged (an
        SGLang that dies or hangs meanwhile would go unrestarted for ``--validate-timeout``)."""
        self.state.sglang_loading_step = step
        self._loads_started += 1
        try:
            yield
        finally:
            self.state.sglang_loading_step = None

    def loading(self, step: int) -> None:
        """Mark ``step`` as being loaded (a full checkpoint or an adapter): the heartbeat writes
        the ack file now, beside the load, so that the trainer's retention spares the step."""
        self.state.loading_step = step
        if self._ack_now is not None:
            self._ack_now.set()

    def died_during_load(self, ckpt: PublishedCheckpoint, exc: SGLangUnavailable) -> None:
        """SGLang stopped answering while it loaded ``ckpt`` (a full checkpoint or an adapter):
        count it against the step and, at ``MAX_CRASHES_PER_STEP``, reject the step
        (``sglang_crashed_on_load``). A step that kills SGLang at every load would otherwise be
        loaded again after each restart, forever, and the replica would never serve anything."""
        step = ckpt.step
        self.state.sglang_healthy = False
        self.metrics.syncs.labels("failed", "sglang_unavailable").inc()
        if isinstance(exc, (SGLangErrorAnswer, SGLangNotReached)):  # a proxy's 5xx, or never sent: not a crash
            self._error("sglang_unavailable", str(exc), step=step)
            return
        self._crashes[step] = self._crashes.get(step, 0) + 1
        if self._crashes[step] >= MAX_CRASHES_PER_STEP:
            self._reject(
                ckpt,
                "sglang_crashed_on_load",
                f"SGLang died {self._crashes[step]} times while loading {ckpt.path.name}",
            )
        else:
            self._error("sglang_unavailable", str(exc), step=step)

    def _look_before_load(self, ckpt: PublishedCheckpoint) -> tuple[bool, float | None, tuple[int, ...] | None]:
        """(Blocking: on the root.) Whether ``ckpt`` is an adapter step, when it was published
        (only the first time it loads: latencies mean nothing after), and its publication identity."""
        identity = _publication_identity(ckpt.path)
        published = None if ckpt.step in self._loaded_before else published_at(ckpt.path)
        return is_adapter_step(ckpt.path, self.root), published, identity

    def _validation_stuck(self) -> bool:
        return self._straggler is not None and not self._straggler.done()

    async def bounded(self, fn: Callable[..., T], *args: Any, name: str, step: int) -> T | None:
        """``fn(*args)`` (a validation: blocking) in a thread, given up on at the validation
        deadline plus 5 s (``asyncio.TimeoutError``). A thread given up on may still be blocked in
        the storage: until it ends no other starts, so two never work in the stage at once; the
        step ``name`` then waits (None, with ``validation_stuck`` in ``last_error``)."""
        if self._validation_stuck():
            self._error(
                "validation_stuck",
                f"an earlier validation is still blocked in the storage; {name} waits for it"
                " (check the checkpoint root's file system)",
                step=step,
            )
            return None
        task = in_daemon_thread(fn, *args, name=f"validating {name}")
        self._root_hung_in_validation = False
        watch = asyncio.create_task(self._watch_root(task))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=self.settings.validate_timeout_s + 5.0)
        except asyncio.TimeoutError:
            self._straggler = task
            task.add_done_callback(_drop_result)
            raise
        finally:
            watch.cancel()

    async def _watch_root(self, validation: asyncio.Future[Any]) -> None:
        """While ``validation`` runs, look at the root every ``--root-timeout``: a look that
        does not come back marks the validation as cut short by the root (see
        :meth:`reject_unless_root`), even when the root answers again before it ends."""
        while not validation.done():
            await asyncio.sleep(self.settings.root_timeout_s)
            if validation.done():
                return
            try:
                await self.root_gate.call(_look_at, self.root, what="looking at the root during a validation")
            except RootUnresponsive:
                # Only a look that did not come back: all threads busy says nothing about the root.
                self._root_hung_in_validation |= self.root_gate.problem is not None
            except OSError:
                pass  # it answered: what the error says is the validation's to find

    async def reject_unless_root(
        self, ckpt: PublishedCheckpoint, reason: str, message: str, *, storage: bool = False
    ) -> None:
        """Reject ``ckpt`` for a failed validation, unless the checkpoint root stopped answering
        during it (a look at the root then, or one now, that did not come back or failed): a hung
        or failing file system (an NFS server down, a soft mount's EIO) would otherwise cost a good
        step for good. Such a step is not rejected; it is validated again once the root answers.
        ``storage``: the failure was the storage's, reading the step's files (an ``OSError``: EIO,
        ESTALE...), while the root answers: the step is rejected only the
        :data:`MAX_STORAGE_FAULTS_PER_STEP`-th time in a row (a blip costs no step)."""
        hung = self._root_hung_in_validation
        if not hung:
            try:
                await self.root_gate.call(
                    _look_at, self.root, what=f"looking at the root after {ckpt.path.name} failed"
                )
            except RootUnresponsive:
                hung = self.root_gate.problem is not None  # not when all threads were only busy
            except OSError as exc:  # the root's own look fails too: the file system, not the step
                hung = True
                message = f"{message}; the root itself failed: {exc}"
        if not hung and storage:
            faults = self._storage_faults[ckpt.step] = self._storage_faults.get(ckpt.step, 0) + 1
            if faults < MAX_STORAGE_FAULTS_PER_STEP:
                log.warning("step %d: %s; the storage failed: it is validated again", ckpt.step, message)
                self.metrics.syncs.labels("failed", "storage_error").inc()
                self._error(
                    "storage_error",
                    f"{message} (the storage failed: {ckpt.path.name} is validated again, and rejected if it"
                    " fails so once more)",
                    step=ckpt.step,
                )
                return
        if not hung:
            self._storage_faults.pop(ckpt.step, None)
            self._reject(ckpt, reason, message)
            return
        log.warning("not rejecting step %d (%s: %s): the checkpoint root stopped answering", ckpt.step, reason, message)
        self.metrics.syncs.labels("failed", "root_unresponsive").inc()
        self._error(
            "root_unresponsive",
            f"validating {ckpt.path.name} was cut short while the checkpoint root {self.root} did not"
            f" answer ({reason}: {message[:300]}); {ckpt.path.name} is not rejected and is validated"
            " again once the root answers",
            step=ckpt.step,
        )

    def _record_sync(self, manifest: Manifest, record: SyncRecord) -> None:
        """Mark ``record``'s step served, with its record and metrics.

        The served step and its record change together, with no await between them: a /wait
        woken in between would otherwise report the new step with the old record.
        """
        step = record.step
        self._set_loaded(step, manifest, record.path)
        self.state.last_sync = record
        self._loaded_before.add(step)
        self._unconfirmed = None
        self._crashes.pop(step, None)
        self._storage_faults.pop(step, None)
        self._identity_seen.pop(step, None)
        if self.state.last_error is not None and self.state.last_error.get("step") == step:
            self.state.last_error = None
        self.metrics.syncs.labels("loaded", "ok").inc()
        self.metrics.record_sync(record)

    def _set_loaded(self, step: int, manifest: Manifest, served_path: str) -> None:
        self.state.loaded_step = step
        self.state.loaded_run_id = manifest.run_id
        self.state.loaded_fingerprint = manifest.source_fingerprint()
        self.state.loaded_current = True
        self._served_path = served_path

    def _prepare(self, path: Path) -> tuple[ValidationReport, StagedBuild | None]:
        """Validate ``path`` and, with a stage, copy or rebuild it there and validate the copy
        (runs in a thread)."""
        s = self.settings
        deadline = Deadline(s.validate_timeout_s)
        staged = self.stage is not None
        report = validate_checkpoint(
            path,
            root=self.root,
            reference=self._reference,
            allow_float_cast=True,
            check_digests=s.check_digests and not staged,
            check_finite=s.check_finite and not staged,
            timeout_s=s.validate_timeout_s,
        )
        if self.stage is None:
            if report.manifest.kind == "delta":
                raise CheckpointError(
                    "delta_needs_stage",
                    f"{path.name} is a delta checkpoint, which is rebuilt in the sidecar's stage"
                    " directory: run the sidecar without --no-stage (or publish full checkpoints:"
                    " checkpoint_delta=False)",
                )
            report.manifest = report.manifest.as_copy()  # SGLang reads the published step itself
            return report, None
        built = self.stage.build(self.root, report.path, report.manifest, deadline, check_finite=s.check_finite)
        remaining = max(0.001, s.validate_timeout_s - (time.monotonic() - deadline.started))
        try:
            # A rebuild onto a staged copy checked the tensors its deltas changed; the others are
            # that copy's, checked when this process staged it: no second read of the whole model.
            # A full copy, a chain replayed from a full step copied in, and a copy found staged
            # (a killed sidecar may have renamed it into place before its check) are checked whole.
            staged_report = validate_checkpoint(
                built.path,
                root=self.stage.path,
                reference=self._reference,
                allow_float_cast=True,
                check_finite=s.check_finite and not built.finite_checked,
                timeout_s=remaining,
            )
            if staged_report.manifest.source_fingerprint() != report.manifest.fingerprint():
                raise CheckpointError(
                    "changed_while_staging", f"{path.name}'s manifest changed while it was being staged"
                )
        except BaseException:
            self._remove_copy(built)
            raise
        if s.check_finite:  # checked whole just now, or a rebuild on a copy checked whole before
            self.stage.mark_finite(built.path)
        staged_report.digests_checked = True
        return staged_report, built

    async def _discard_copy(self, built: StagedBuild | None) -> None:
        """Remove the staged copy of a step that was not loaded (beside the loop)."""
        if built is not None:
            await asyncio.to_thread(self._remove_copy, built)

    def _remove_copy(self, built: StagedBuild) -> None:
        """(Blocking.) Remove ``built``, a copy SGLang does not serve: a failed step's copy would
        hold a model's worth of the stage (RAM, in /dev/shm) until some later load succeeded, and
        leave no room to stage the next step meanwhile."""
        assert self.stage is not None
        served = self._served_path
        if served is not None and os.path.realpath(served) == os.path.realpath(built.path):
            return
        if self.stage.owns(built.path):
            with contextlib.suppress(OSError):  # a copy left is removed at the next prune or start
                remove_entry(built.path)  # the stage's own removal: never half-deleted under its name
            self.state.stage_bytes = self.stage.usage_bytes()
            self.metrics.stage_bytes.set(self.state.stage_bytes)

    def _reject(self, ckpt: PublishedCheckpoint, reason: str, message: str) -> None:
        self._error(reason, message, step=ckpt.step)
        assert self.state.last_error is not None
        log.error("rejected checkpoint step %d (%s): %s", ckpt.step, reason, self.state.last_error["message"])
        self.state.rejected[ckpt.step] = reason
        self._rejected_at[ckpt.step] = self._identity_seen.get(ckpt.step)
        self.metrics.syncs.labels("rejected", reason).inc()

    def _error(self, reason: str, message: str, step: int | None = None) -> None:
        """Record the last error (``/status``, the ack file): its message cut as ack readers cut it
        (it may quote untrusted names and answers of any length)."""
        message = shown_text(message, MAX_ACK_TEXT)
        self.state.last_error = {"reason": reason, "message": message, "step": step, "at": time.time()}

    async def _maybe_ack(self, force: bool = False) -> None:
        assert self._ack_lock is not None
        async with self._ack_lock:
            now = time.monotonic()
            if not force and now - self._last_ack < self.settings.ack_interval_s:
                return
            self._last_ack = now
            s = self.state
            try:
                await self.root_gate.call(self.acks.write, s.report(), what="writing the ack file")
                s.ack_error = None
            except (OSError, RootUnresponsive) as exc:
                if s.ack_error is None:
                    log.error("cannot write the ack file under %s: %s (HTTP acks still work)", self.root, exc)
                s.ack_error = str(exc)


FOLDER_REASONS = frozenset(
    {
        "bad_manifest",
        "missing_manifest",
        "path_escape",
        "not_a_checkpoint",
        "missing_checkpoint",
        "too_many_entries",
    }
)
"""Rejections about the step's folder or its manifest alone: they end when either changes (the
folder's own ``lstat`` changes when an entry is added, removed or renamed in it: all that can
change how many it holds). Every other reason is about what the files hold (a shard, the config
or the index seen before its bytes were all there) and ends when any file of the step changes
too: a checkpoint copied in file by file, in any order, loads once complete."""

RESCAN_ENTRIES = MAX_CHECKPOINT_ENTRIES
"""Entries of rejected steps' folders one listing looks at, all steps together (see
:meth:`SyncController._listing`; the first step it reads is read whole, up to
``MAX_CHECKPOINT_ENTRIES``): a listing's cost does not grow with the junk rejected."""


def _read_identity(path: Path, files: bool = True) -> tuple[int, ...]:
    """What changes when a step directory is republished, or its manifest written anew in place,
    and (``files``) when any of its files changes (a checkpoint copied in file by file, in any
    order): a rejection stands until then. Raises ``OSError``."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):  # a link named like a step is not followed (it may lead to a hung mount)
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    m = os.lstat(path / MANIFEST_NAME)
    shallow = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, m.st_ino, m.st_size, m.st_mtime_ns, m.st_ctime_ns)
    if not files:
        return shallow
    files_part, _ = _files_identity(path)
    assert files_part is not None
    return (*shallow, files_part)


def _files_identity(path: Path, limit: int = MAX_CHECKPOINT_ENTRIES) -> tuple[int | None, int]:
    """(Blocking.) The files' part of :func:`_read_identity` (the first ``MAX_CHECKPOINT_ENTRIES``
    entries of the folder ``path``: a folder holding more was rejected for it), and how many
    entries were looked at; None instead of the part when the folder holds more than ``limit``
    (below ``MAX_CHECKPOINT_ENTRIES``): given up on after ``limit``. Raises ``OSError``."""
    seen: list[tuple[str, int, int, int, int]] = []
    with os.scandir(path) as entries:
        for entry in entries:
            if len(seen) >= MAX_CHECKPOINT_ENTRIES:
                break
            if len(seen) >= limit:
                return None, len(seen)
            f = entry.stat(follow_symlinks=False)
            seen.append((entry.name, f.st_ino, f.st_size, f.st_mtime_ns, f.st_ctime_ns))
    return hash(tuple(sorted(seen))), len(seen)


def _publication_identity(path: Path) -> tuple[int, ...] | None:
    """:func:`_read_identity`, or None when it cannot be read."""
    try:
        return _read_identity(path)
    except OSError:
        return None


NOT_LOADABLE_NOW = frozenset({"older_than_served", "checkpoint_rejected"})
"""``request_checkpoint``'s refusals of a step that exists but that the loop would not load now
(``POST /sync`` answers them 409, a bad name 400)."""


def _same_publication(seen: tuple[int, ...] | None, then: tuple[int, ...] | None) -> bool:
    """A rejected step's identity read now (``seen``) is the one it was rejected with (``then``);
    a look without the files' part compares the folder and manifest only."""
    return seen == then or bool(seen and then and seen == then[: len(seen)])


def _served_in(ack: dict[str, Any] | None) -> tuple[int, str] | None:
    """The step and fingerprint an ack says its replica served, or None."""
    step, fingerprint = (ack or {}).get("loaded_step"), (ack or {}).get("fingerprint")
    if isinstance(step, int) and not isinstance(step, bool) and isinstance(fingerprint, str):
        return step, fingerprint
    return None


def _rejection_identity(path: Path) -> tuple[int, ...] | None:
    """(Blocking: on the root.) A rejected step's folder-and-manifest identity, as
    :meth:`SyncController._still_rejected` compares it (without the files' part: no scan of the
    folder); None when the step is gone. Raises ``OSError`` when it cannot be read (the rejection
    stands)."""
    try:
        return _read_identity(path, files=False)
    except FileNotFoundError:
        return None  # gone, or half replaced: looked at anew


def _is_folder(path: Path) -> bool:
    """(Blocking: on the root.) ``path`` is a folder itself: a link named like a step is not
    followed (it may lead to a file system that does not answer)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _look_at(root: Path) -> None:
    """(Blocking: on the root.) Open the root and read its first entry: a look that goes to the
    file system's server (a cached ``stat`` may not)."""
    with os.scandir(root) as entries:
        next(entries, None)


def _drop_result(future: asyncio.Future[Any]) -> None:
    """A straggling validation's outcome: already reported as a timeout, read so that asyncio
    does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
