"""Adapter sync: serving an ``adapter`` checkpoint step through SGLang's LoRA endpoints.

The sync loop (``controller.py``) hands every step whose manifest says ``kind: "adapter"`` to
:class:`AdapterSync`. For step N it

1. validates the adapter against the model SGLang serves and the server's LoRA limits from
   ``/server_info`` (``adapter_reader.validate_adapter``: files, config, every tensor's shape,
   rank <= ``--max-lora-rank``, modules within ``--lora-target-modules``), checks that it was
   trained on the model SGLang serves (``base_values``: ``adapter_base_mismatch``; a served
   model's folder that cannot be read is ``base_model_unreadable``, tried again, not the step's
   fault), and with a stage copies it node-locally checking every byte against the manifest
   and for NaN/Inf;
2. loads it with ``POST /load_lora_adapter`` under the name ``adapter_name_for(N, run_id)``
   (a fresh name per version: SGLang keys its prefix cache by adapter name). A name this
   sidecar loaded from the same publication is not loaded again; any other name SGLang already
   has (step N republished, or loaded by an earlier sidecar process) is replaced only after the
   new files loaded under a trial name, so files SGLang refuses leave the served adapter in
   place; a load during which SGLang dies counts against the step as a full load does (rejected
   as ``sglang_crashed_on_load``);
3. confirms that SGLang lists the adapter (``/v1/models``), then marks N as served and acks it,
   as a full load does (``/wait``, ack files);
4. unloads the adapters loaded before the newest ``--lora-keep`` loads (by load order, never the
   served one: a root reused by another run starts again at low steps). SGLang's unload takes
   the name out of its registry and waits for the requests already using the adapter, so no
   request in flight loses it; the unload runs beside the loop, never blocking it. It does not
   refuse a later request that names the adapter: SGLang 0.5.23 loads it again by itself, from
   the path it last loaded it from (``tokenizer_manager._resolve_lora_path``; with a stage, the
   staged copy, so the request fails once the copy is pruned), and the adapter then stays loaded
   untracked (a restarted sidecar adopts it and retires it in turn). The trainer names the newest
   version every replica acknowledged, which ``--lora-keep`` keeps loaded.

An adapter changes the base model SGLang was started with: after a full checkpoint was loaded
into the server (its weight version is a step), adapters are refused (``adapter_base_replaced``)
until SGLang restarts on its base. A restarted SGLang has no adapters: the loop notices that the
served adapter is gone (:meth:`AdapterSync.still_served`) and loads the newest one again. A
restarted sidecar beside a live SGLang adopts the adapters an earlier sidecar process loaded
(:meth:`AdapterSync._adopt`): they are retired in turn as newer ones load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..adapter_reader import AdapterReport, LoraLimits, validate_adapter
from ..base_values import check_base_values
from ..checkpoint_format import CheckpointError, Manifest
from ..checkpoint_reader import PublishedCheckpoint
from ..protocol import adapter_name_for, step_for_adapter_name, step_for_version
from ..untrusted_files import Deadline
from .sglang_client import SGLangErrorAnswer, SGLangLoadRejected, SGLangUnavailable
from .staging import StageError
from .sync_record import SyncRecord

if TYPE_CHECKING:
    from .controller import SyncController

log = logging.getLogger(__name__)

TRIAL_SUFFIX = ".trial"
"""Appended to an adapter's name to load its new files once before they replace it
(:meth:`AdapterSync._replace`); never a name the trainer asks for."""


def is_adapter_step(path: Path, root: Path) -> bool:
    """Whether the step directory's manifest says ``kind: "adapter"`` (False when unreadable:
    the full path then rejects it with its own reason)."""
    try:
        return Manifest.load(path, root=root).kind == "adapter"
    except (CheckpointError, OSError):
        return False


REPLACE_TRIES = 3
"""Unload-and-load rounds :meth:`AdapterSync._replace` makes while requests keep making SGLang
load the old files again under the name (then the step is tried again at the next pass)."""


NAME_TAKEN = ("already loaded", "incomplete unload")
"""What SGLang 0.5.23 says when it refuses a load for its name, not its files: the scheduler has
an adapter under it (``lora_manager``: "... because it is already loaded"), or an unload of it took
it off ``/v1/models`` but failed in the scheduler (``tokenizer_control_mixin``: "... has an
incomplete unload. Retry the unload before loading it again.")."""


def _says_name_taken(refused: SGLangLoadRejected) -> bool:
    """Whether SGLang's refusal of a load names the name, not the files (:data:`NAME_TAKEN`)."""
    return any(words in str(refused) for words in NAME_TAKEN)


class _ReplaceRaced(Exception):
    """Requests kept SGLang loading an adapter's old files again while it was being replaced: the
    new files loaded fine under the trial name, so the step is not at fault (tried again)."""


class _TrialInTheWay(Exception):
    """The trial name (:data:`TRIAL_SUFFIX`) is still taken in SGLang by an earlier replacement's
    trial that SGLang would not unload (or did not answer the unload of): the bookkeeping of the
    name, not the step's files, is at fault (tried again at the next pass)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _BaseUnreadable(Exception):
    """The served model's folder could not be read for the adapter base check: the operator's
    folder is at fault, not the step."""


def _trial_stuck(trial: str, refused: SGLangLoadRejected) -> str:
    """The error of a trial name SGLang keeps taken (:class:`_TrialInTheWay`), saying what to do."""
    return (
        f"SGLang keeps the trial name {trial!r} taken (left by an earlier replacement whose unload SGLang"
        f" refused, or it would not free it now): {refused}. The step's files are not at fault: tried again"
        f" at the next pass. Should this go on, unload it by hand (POST /unload_lora_adapter"
        f' {{"lora_name": "{trial}"}}) or restart SGLang'
    )


class AdapterSync:
    """Loads, confirms and retires LoRA adapter versions in one SGLang server."""

    def __init__(self, controller: SyncController, keep: int):
        self.c = controller
        self.keep = keep
        self.loaded: dict[str, str | None] = {}
        """Adapter name -> the fingerprint of the publication SGLang has under it, for the adapters
        this sidecar tracks (loaded and not unloaded), in load order, oldest first: the order they
        are retired in. None: not known (adopted from an earlier sidecar process, :meth:`_adopt`)."""
        self._adopted = False
        """Whether SGLang's adapters were looked at once, for :meth:`_adopt`."""
        self._adopted_from: dict[str, str] = {}
        """Adopted name -> the path SGLang says it loaded it from (see :meth:`_has_publication`)."""
        self.serving: str | None = None
        """The adapter the served step names (None when the served step is a full checkpoint)."""
        self._unloads: set[asyncio.Task] = set()
        """The unloads running beside the loop (:meth:`_unload_beside`; each task is named after its
        adapter): a name is not loaded or unloaded again before its unload ended (:meth:`_settle`)."""
        self._base_unknown_logged = False

    async def still_served(self) -> bool:
        """False when SGLang no longer has the served adapter (it restarted)."""
        if self.serving is None:
            return True
        try:
            names = await self.c.client.loaded_adapters()
        except SGLangUnavailable:
            return True  # not answering: the health check decides
        if self.serving in names:
            return True
        self.loaded = {n: f for n, f in self.loaded.items() if n in names}
        self.serving = None
        return False

    def forget_serving(self) -> None:
        """A full checkpoint is served now."""
        self.serving = None

    async def try_load(self, ckpt: PublishedCheckpoint, published: float | None) -> bool | None:
        """Validate, stage, load and confirm one adapter step (``published``: when, if this is
        its first load), as the controller's ``_try_load``: True when SGLang serves it, False when
        not (an older step may be tried), None when not for a reason that is not the step's
        (SGLang's state or answers, the served model's folder): the pass ends, since an older step
        would meet the same, and an older full step would replace SGLang's base model, after which
        no adapter loads until SGLang restarts."""
        c = self.c
        step, path = ckpt.step, ckpt.path
        detected = c._detected_at.pop(step, time.time())
        c.loading(step)
        try:
            t0 = time.perf_counter()
            try:
                info = await c.client.server_info()
            except SGLangUnavailable as exc:
                c._error("sglang_unavailable", str(exc), step=step)
                return None
            view_version = c.state.sglang_weight_version
            if step_for_version(view_version) is not None:
                # SGLang's state, not the step's: not a rejection (it loads once SGLang serves its base again).
                c.metrics.syncs.labels("failed", "adapter_base_replaced").inc()
                c._error(
                    "adapter_base_replaced",
                    f"{path.name} is a LoRA adapter for the base model, but SGLang serves the full"
                    f" checkpoint version {view_version}; restart SGLang on its base model to serve"
                    " adapters again",
                    step=step,
                )
                return None
            try:
                limits = LoraLimits.from_server_info(info)
            except ValueError as exc:  # SGLang's answer, not the step's fault: tried again next pass
                c._error("sglang_unavailable", f"SGLang's /server_info cannot be read: {exc}", step=step)
                return None
            budget = c.settings.validate_timeout_s
            try:
                report = await c.bounded(self._validate, path, limits, name=path.name, step=step)
                if report is None:
                    return False
                if not await self._base_matches(ckpt, report):
                    return None  # the served model's folder cannot be read: not the step's fault
                if c.stage is not None:
                    report = await c.bounded(self._stage, report, limits, name=path.name, step=step)
                    if report is None:
                        return False
            except asyncio.TimeoutError:
                await c.reject_unless_root(
                    ckpt, "validation_timeout", f"validating adapter {path.name} did not finish within {budget:g} s"
                )
                return False
            except CheckpointError as exc:
                await c.reject_unless_root(ckpt, exc.reason, str(exc), storage=isinstance(exc, OSError))
                return False
            except StageError as exc:  # the stage's fault (no room, a broken disk): not the step's
                c.metrics.syncs.labels("failed", "stage_failed").inc()
                c._error("stage_failed", str(exc), step=step)
                raise
            except Exception as exc:  # whatever broke while reading step N rejects step N
                await c.reject_unless_root(
                    ckpt,
                    "unreadable",
                    f"adapter {path.name} could not be validated: {type(exc).__name__}: {str(exc)[:300]}",
                    storage=isinstance(exc, OSError),
                )
                return False
            validate_s = time.perf_counter() - t0
            name = adapter_name_for(step, report.manifest.run_id)
            t1, load_started_at = time.perf_counter(), time.time()
            fingerprint = report.manifest.source_fingerprint()
            loaded = await self._load(ckpt, name, str(report.path), fingerprint)
            if not loaded:
                return loaded
            load_s = time.perf_counter() - t1
            self.loaded.pop(name, None)  # the newest load now
            self.loaded[name] = fingerprint
            self.serving = name
            c._record_sync(
                report.manifest,
                SyncRecord.ended_now(
                    published=published,
                    created_at=report.manifest.created_at,
                    detected=detected,
                    validate_s=validate_s,
                    load_s=load_s,
                    load_started_at=load_started_at,
                    step=step,
                    weight_version=name,
                    path=str(report.path),
                    run_id=report.manifest.run_id,
                    staged=c.stage is not None,
                    kind="adapter",
                    bytes_read=report.manifest.total_bytes if c.stage is not None else None,
                ),
            )
            log.info(
                "loaded adapter step %d into SGLang as %r (rank %d, %s): validate%s %.3f s, load %.3f s",
                step,
                name,
                report.manifest.adapter.rank if report.manifest.adapter else 0,
                ",".join(report.modules),
                "+stage" if c.stage is not None else "",
                validate_s,
                load_s,
            )
            self._retire()
            await c._wake_after_load(step)
            if c.stage is not None:  # no spare: adapter syncs do not write full copies
                await asyncio.to_thread(c.stage.prune, {report.path}, keep_spare=False)
            await c._maybe_ack(force=True)
            await c._publish_state()
            return True
        finally:
            c.state.loading_step = None

    async def _load(self, ckpt: PublishedCheckpoint, name: str, path: str, fingerprint: str) -> bool | None:
        """Load ``path`` (the publication ``fingerprint``) into SGLang as ``name`` unless SGLang
        has it already (:meth:`_has_publication`), and confirm that SGLang lists it; when it is
        not served, reported, False (the step's doing: refused, or SGLang died of it) or None (not
        the step's: see :meth:`try_load`). SGLang dying meanwhile counts against the step (the
        controller's ``died_during_load``: rejected once it killed SGLang ``MAX_CRASHES_PER_STEP``
        times); a confirmation SGLang does not give while it answers does not."""
        c = self.c
        await self._settle(name, name + TRIAL_SUFFIX)
        try:
            listed = await c.client.loaded_adapters()
        except SGLangUnavailable as exc:  # before any load: not the step's doing
            c.state.sglang_healthy = False
            c.metrics.syncs.labels("failed", "sglang_unavailable").inc()
            c._error("sglang_unavailable", str(exc), step=ckpt.step)
            return None
        before = set(listed) if self._adopted else await self._adopt(listed)
        try:
            with c.sglang_loading(ckpt.step):
                if name in before and self._has_publication(name, fingerprint, path):
                    log.info("SGLang already has adapter %r from %s: not loaded again", name, ckpt.path.name)
                elif name in before:  # republished, or loaded by an earlier process: maybe other files
                    await self._replace(name, path, before)
                else:
                    await c.client.load_lora_adapter(name, path)
        except SGLangLoadRejected as exc:
            await self._forget_unless_listed(name)
            c._reject(ckpt, "sglang_rejected", str(exc))
            return False
        except _ReplaceRaced as exc:  # the old files under the name, as before (or none: then forgotten)
            await self._forget_unless_listed(name)
            c.metrics.syncs.labels("failed", "adapter_replace_raced").inc()
            c._error("adapter_replace_raced", str(exc), step=ckpt.step)
            return None
        except _TrialInTheWay as exc:  # SGLang serves the old files under the name, as before
            if exc.reason == "sglang_unavailable":
                c.state.sglang_healthy = False
            c.metrics.syncs.labels("failed", exc.reason).inc()
            c._error(exc.reason, str(exc), step=ckpt.step)
            return None
        except SGLangUnavailable as exc:
            c.died_during_load(ckpt, exc)
            return False
        try:
            confirmed = name in await c.client.loaded_adapters()
        except SGLangUnavailable as exc:
            # SGLang took the load; the list that confirms it did not come. Only an SGLang that no
            # longer answers at all died of the step (a proxy's 5xx, a slow list: looked at again).
            if isinstance(exc, SGLangErrorAnswer) or (await c.client.view()).healthy:
                self.loaded[name] = fingerprint  # SGLang said it loaded it: not loaded again if listed
                self._not_confirmed(
                    ckpt, f"SGLang took {ckpt.path.name} as {name!r}, but its adapter list did not come: {exc}"
                )
                return None
            c.died_during_load(ckpt, exc)
            return False
        if not confirmed:
            self._forget(name)
            self._not_confirmed(
                ckpt, f"after loading {ckpt.path.name} SGLang does not list the adapter {name!r} in /v1/models"
            )
            return False
        return True

    def _not_confirmed(self, ckpt: PublishedCheckpoint, message: str) -> None:
        """Report an adapter load SGLang did not confirm (``adapter_not_confirmed``: looked at again)."""
        self.c.metrics.syncs.labels("failed", "adapter_not_confirmed").inc()
        self.c._error("adapter_not_confirmed", message, step=ckpt.step)

    def _has_publication(self, name: str, fingerprint: str, path: str | None = None) -> bool:
        """Whether what SGLang has under ``name`` is the publication ``fingerprint``, because
        this process loaded it from that publication. What an earlier process loaded under a
        name is not known (:meth:`_adopt`): the name says step and run only, and a root reused
        with the same run id (or none) or a step republished meanwhile reuses it."""
        if self.loaded.get(name) == fingerprint:
            return True
        # Adopted: the same publication when SGLang loaded it from this step's staged copy, whose
        # name carries the publication's fingerprint (Stage._name_for) and whose bytes were checked.
        return (
            name in self.loaded
            and self.loaded[name] is None
            and path is not None
            and self.c.stage is not None
            and self._adopted_from.get(name) == path
            and self.c.stage.owns(path)
        )

    async def _adopt(self, listed: dict[str, str | None]) -> set[str]:
        """Once, at this process's first look at SGLang's adapters (``listed``): track those an
        earlier sidecar process loaded, as the oldest loads (by step), so that they are retired
        in turn rather than left loaded forever. Names :func:`adapter_name_for` did not make are
        not this sidecar's and are left alone; a trial left by a process stopped in the middle of
        a replacement is unloaded now. Returns the names SGLang still has."""
        self._adopted = True
        ours = sorted(
            (step, n) for n in listed if (step := step_for_adapter_name(n.removesuffix(TRIAL_SUFFIX))) is not None
        )
        left = set(listed)
        for _, name in ours:
            if name.endswith(TRIAL_SUFFIX):
                if await self._unload(name, "a trial left by a sidecar stopped in the middle of a replacement"):
                    left.discard(name)
            elif name not in self.loaded:
                self.loaded[name] = None
                if listed[name] is not None:
                    self._adopted_from[name] = str(listed[name])
        adopted = [n for n, f in self.loaded.items() if f is None]
        if adopted:
            log.info("adopted the adapters SGLang already has (loaded by an earlier sidecar): %s", ", ".join(adopted))
        return left

    async def _replace(self, name: str, path: str, loaded: set[str]) -> None:
        """Load ``path`` as ``name``, which SGLang already has (``loaded``: its adapters).

        SGLang 0.5.23 has no rename and refuses a second adapter under a name it has, and the
        trainer's requests name this very adapter (``adapter_name_for``), so the old one must
        go before the new one loads. The new files are first loaded under a trial name (and
        unloaded again beside the loop): files SGLang refuses (``SGLangLoadRejected``) then
        leave the adapter being served untouched. Only files SGLang just took replace it.

        A request naming ``name`` while it is unloaded makes SGLang load it again by itself, from
        the path it last loaded it from (``tokenizer_manager._resolve_lora_path``), and the load
        here is then refused as "already loaded". When SGLang lists ``name`` from ``path`` (no
        stage: the step's folder, whose files the trial load just took), it serves what this load
        would have: that counts as loaded. From another path (an older publication's staged copy)
        the old files are unloaded and the new ones loaded again, :data:`REPLACE_TRIES` rounds at
        most; then :class:`_ReplaceRaced` (not the step's fault: tried again at the next pass).

        The trial name is this sidecar's bookkeeping: a trial an earlier replacement left loaded
        (its unload beside the loop refused or unanswered, or a sidecar stopped in between) is
        unloaded first (:meth:`_clear_trial`), also when only the trial load's refusal shows it
        (:data:`NAME_TAKEN`: an unload that failed in SGLang's scheduler took it off ``/v1/models``
        but not out of the scheduler, or ``loaded`` was read before it came back). A trial that cannot be
        unloaded is :class:`_TrialInTheWay`, never a refusal of the step's files. (An unload of
        it still running beside the loop was waited for before ``loaded`` was read: ``_settle``.)"""
        client = self.c.client
        trial = name + TRIAL_SUFFIX
        if trial in loaded:  # left by an earlier replacement, or a sidecar stopped in the middle of one
            await self._clear_trial(trial)
        try:
            await client.load_lora_adapter(trial, path)
        except SGLangLoadRejected as exc:
            if not await self._name_taken(trial, exc):
                raise  # the files were refused
            await self._clear_trial(trial)  # the name was taken, the files not looked at
            try:
                await client.load_lora_adapter(trial, path)
            except SGLangLoadRejected as second:
                if not await self._name_taken(trial, second):
                    raise
                raise _TrialInTheWay("adapter_trial_in_the_way", _trial_stuck(trial, second)) from None
        self._unload_beside(trial, "its files were only tried before they replaced the served ones")
        again: str | None = None
        refused: SGLangLoadRejected | None = None
        for _ in range(REPLACE_TRIES):
            try:
                await client.unload_lora_adapter(name)
            except SGLangLoadRejected as exc:  # gone already, or its unload failed in SGLang: the load tells
                refused = exc
                log.warning("SGLang refused to unload adapter %r before its new files replace it: %s", name, exc)
            try:
                await client.load_lora_adapter(name, path)
                return
            except SGLangLoadRejected as exc:
                if not _says_name_taken(exc):
                    raise
                refused = exc
                again = (await client.loaded_adapters()).get(name)
            if again == path:
                log.info(
                    "SGLang loaded adapter %r from %s again by itself (a request named it): not loaded twice",
                    name,
                    path,
                )
                return
        raise _ReplaceRaced(
            f"SGLang kept the name {name!r} taken while the adapter was replaced ({REPLACE_TRIES} rounds of unload"
            f" and load; requests loading its old files from {again} again, or an unload SGLang could not finish;"
            f" last refusal: {refused}); its new files loaded fine: tried again at the next pass"
        )

    async def _clear_trial(self, trial: str) -> None:
        """Unload ``trial``, an earlier replacement's trial. Its unload being refused is not the
        step's fault: when SGLang no longer lists it (unloaded meanwhile), fine; when it still
        does, or SGLang does not answer, :class:`_TrialInTheWay` (tried again at the next pass)."""
        client = self.c.client
        try:
            await client.unload_lora_adapter(trial)
            log.info("unloaded adapter %r (a trial left by an earlier replacement)", trial)
            return
        except SGLangLoadRejected as exc:
            refused = exc
        except SGLangUnavailable as exc:
            raise _TrialInTheWay(
                "sglang_unavailable",
                f"SGLang did not answer the unload of {trial!r}, left by an earlier replacement: {exc};"
                " tried again at the next pass",
            ) from None
        try:
            still = trial in await client.loaded_adapters()
        except SGLangUnavailable as exc:
            raise _TrialInTheWay("sglang_unavailable", f"{exc} (after SGLang refused to unload {trial!r})") from None
        if not still:
            log.info("adapter %r, left by an earlier replacement, is gone (%s)", trial, refused)
            return
        raise _TrialInTheWay("adapter_trial_in_the_way", _trial_stuck(trial, refused))

    async def _name_taken(self, name: str, refused: SGLangLoadRejected) -> bool:
        """Whether SGLang refused a load of ``name`` for the name, not for the files: it says so
        (:data:`NAME_TAKEN`: its scheduler still has the name, though an unload already took it off
        ``/v1/models``), or it lists the name."""
        if _says_name_taken(refused):
            return True
        return name in await self.c.client.loaded_adapters()

    async def _settle(self, *names: str) -> None:
        """Wait for the unloads of ``names`` still running beside the loop (:meth:`_unload_beside`),
        so that what SGLang lists afterwards no longer changes under a load or unload of them.
        Bounded: each is one call of the client's, under its load timeout."""
        pending = {t for t in self._unloads if t.get_name() in names and not t.done()}
        if pending:
            log.info("waiting for the unload of %s, still running, before the name is used again", ", ".join(names))
            await asyncio.wait(pending)

    async def _forget_unless_listed(self, name: str) -> None:
        """After a refused load: :meth:`_forget` ``name`` when SGLang no longer lists it (its
        replacement was refused after the old one was unloaded). Left as it is when SGLang does
        not answer: the health check decides then."""
        try:
            names = await self.c.client.loaded_adapters()
        except SGLangUnavailable:
            return
        if name not in names:
            self._forget(name)

    def _forget(self, name: str) -> None:
        """SGLang no longer has ``name`` because this sidecar unloaded it: drop it from what is
        loaded and, when it was the served adapter, mark nothing as served. Otherwise the health
        check would take the missing adapter for an SGLang restart (and count one), and
        ``/wait`` would go on confirming a step SGLang does not serve."""
        self.loaded.pop(name, None)
        if self.serving == name:
            self.serving = None
            state = self.c.state
            state.loaded_step = None
            state.loaded_fingerprint = state.loaded_run_id = None

    def _validate(self, path: Path, limits: LoraLimits) -> AdapterReport:
        """(Blocking.) Validate ``path`` where it is published (its bytes too, without a stage).

        Without a stage SGLang reads the published step itself, so the report's manifest is the
        one a copy of it would carry (:meth:`Manifest.as_copy`, as ``controller._prepare`` does
        for a full step): its :meth:`~Manifest.source_fingerprint`, which the served step is
        recorded by, is then the published manifest's :meth:`~Manifest.fingerprint` also when that
        manifest names a source of its own (``extra.reconstructed_from``, which readers accept).
        Otherwise the loop would take the served step for republished at every pass."""
        c = self.c
        s = c.settings
        assert c._reference is not None
        report = validate_adapter(
            path,
            root=c.root,
            reference=c._reference,
            limits=limits,
            check_finite=s.check_finite and c.stage is None,
            check_digests=s.check_digests and c.stage is None,
            timeout_s=s.validate_timeout_s,
        )
        if c.stage is None:
            report.manifest = report.manifest.as_copy()
        return report

    def _stage(self, report: AdapterReport, limits: LoraLimits) -> AdapterReport:
        """(Blocking.) Copy a validated adapter into the stage, checking every byte, and validate the copy."""
        c = self.c
        s = c.settings
        assert c._reference is not None and c.stage is not None
        deadline = Deadline(s.validate_timeout_s)
        copy = c.stage.copy_in(c.root, report.path, report.manifest, deadline)
        remaining = max(0.001, s.validate_timeout_s - (time.monotonic() - deadline.started))
        staged = validate_adapter(
            copy,
            root=c.stage.path,
            reference=c._reference,
            limits=limits,
            check_finite=s.check_finite,
            timeout_s=remaining,
        )
        # The copy carries the published manifest as_copy(): it stands for that publication (as
        # controller._prepare compares a full step's copy).
        if staged.manifest.source_fingerprint() != report.manifest.fingerprint():
            raise CheckpointError(
                "changed_while_staging", f"{report.path.name}'s manifest changed while it was being staged"
            )
        return staged

    async def _base_matches(self, ckpt: PublishedCheckpoint, report: AdapterReport) -> bool:
        """Whether the adapter may load as far as its base is concerned: it was trained on the
        model SGLang serves, or that cannot be told (see :meth:`_check_base`). Raises
        ``CheckpointError('adapter_base_mismatch')`` (the step is rejected) when it was not.

        The served model's folder is the operator's, not the step's: when it cannot be read (a
        shard missing under its index, a file that is no safetensors, storage that does not
        answer within ``--validate-timeout``) the step is not rejected. The error says
        ``base_model_unreadable`` and the step is tried again at the next pass."""
        c = self.c
        try:
            checked = await c.bounded(
                self._check_base, report, ckpt.path, name=f"{ckpt.path.name} (base check)", step=ckpt.step
            )
        except asyncio.TimeoutError:
            problem = f"reading it did not finish within {c.settings.validate_timeout_s:g} s"
        except _BaseUnreadable as exc:
            problem = str(exc)
        else:
            return checked is not None
        c.metrics.syncs.labels("failed", "base_model_unreadable").inc()
        c._error(
            "base_model_unreadable",
            f"cannot tell whether {ckpt.path.name} was trained on the model SGLang serves: its folder"
            f" {c.base_dir} cannot be read ({problem}); the step is tried again. Repair the folder or"
            " pass --reference-dir with a readable copy of the base model",
            step=ckpt.step,
        )
        return False

    def _check_base(self, report: AdapterReport, path: Path) -> bool:
        """(Blocking.) ``adapter_base_mismatch`` unless the adapter was trained on the base model
        SGLang serves, by the digests of base tensors its manifest records; nothing is compared
        when it records none or the base model's folder is not known (logged once). Any other
        failure to read the folder is :class:`_BaseUnreadable`."""
        info = report.manifest.adapter
        if info is None or not info.base_values:
            return True
        base_dir = self.c.base_dir
        if base_dir is None:
            if not self._base_unknown_logged:
                self._base_unknown_logged = True
                log.warning(
                    "cannot tell whether adapters were trained on the model SGLang serves: its folder is"
                    " not known here (pass --reference-dir with the base model's folder to compare them)"
                )
            return True
        try:
            report.checks.append(check_base_values(info.base_values, base_dir, where=path.name))
        except CheckpointError as exc:
            if exc.reason == "adapter_base_mismatch":
                raise
            raise _BaseUnreadable(f"{exc.reason}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise _BaseUnreadable(f"{type(exc).__name__}: {exc}") from None
        return True

    def _retire(self) -> None:
        """Unload the adapters loaded before the newest ``keep`` loads, beside the loop, never the
        served one. By load order, not by step: a root emptied and reused by another run starts
        again at low steps, and its adapters are the newest then, not the first to go."""
        while len(self.loaded) > self.keep:
            name = next((n for n in self.loaded if n != self.serving), None)
            if name is None:
                return
            del self.loaded[name]
            self._unload_beside(name, f"loaded before the newest {self.keep}")

    def _unload_beside(self, name: str, why: str) -> None:
        """Unload ``name`` in a task of its own: SGLang's unload waits for the requests using the
        adapter, which the loop must not wait for."""
        task = asyncio.get_running_loop().create_task(self._unload(name, why), name=name)
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, name: str, why: str) -> bool:
        """Unload ``name``; False, logged, when SGLang refused or did not answer."""
        try:
            await self.c.client.unload_lora_adapter(name)
        except (SGLangLoadRejected, SGLangUnavailable) as exc:
            log.warning("could not unload adapter %r (%s): %s", name, why, exc)
            return False
        log.info("unloaded adapter %r (%s)", name, why)
        return True
