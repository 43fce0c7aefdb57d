"""Publishing the policy as a checkpoint version and waiting until the replicas serve it.

:class:`CheckpointPublisher` owns the trainer's side of a sync on the main process: it picks
the next version (one above any checkpoint already published under the root, so versions only
grow, also across restarts), streams the weights into ``publish_checkpoint`` (one shard in memory
at a time), wakes the sidecars, waits for every expected replica through a
:class:`~trainer_hooks.replica_wait.ReplicaWaiter`, prunes old checkpoints, and records how long
each phase took (:class:`SyncRecord`).

Every sync takes one path (:meth:`CheckpointPublisher.publish`): the weights are *taken in*
on the calling thread (the gather, which is collective), then a job writes the checkpoint and
waits for the replicas; it returns a ``concurrent.futures.Future`` of the job. In the
foreground the caller waits for the job before it returns; in the background it runs on a worker
thread while training goes on (at most one is in flight: the next sync first waits for it, and
an error in the worker is raised by the next call into the publisher). Either wait logs its
progress and gives up on a write blocked in the storage (see :func:`background_sync_bound_s`):
a foreground job runs on a thread of its own too, the caller watching it (and drawing the
weights, which a streamed write takes from it through a small queue).
A checkpoint the caller writes itself (the LoRA adapter, ``adapter_publish.py``) takes the same
path through :meth:`CheckpointPublisher.publish_prepared`, with the caller's writer as the job's
write.

Taking in depends on what the job needs to outlive the live parameters:

- with deltas (``delta=DeltaCheckpointWriter``): the weights go into the delta writer's one held
  copy of the last version (XOR + zstd while gathering), in the foreground and the background;
- without deltas, in the background: a CPU copy in the checkpoint dtype (pinned buffers reused
  across syncs when the weights are on a GPU);
- without deltas, in the foreground: nothing; the job streams the weights into the shards.

Floating tensors on a GPU are cast to the checkpoint dtype there, before they are copied to the
CPU (:func:`cast_on_device`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import queue
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import torch

from rollout_service.checkpoint_format import MAX_STEP, CheckpointError, Manifest, new_run_id, step_dir_name
from rollout_service.checkpoint_reader import PublishedCheckpoint
from rollout_service.checkpoint_writer import (
    PublishResult,
    publish_checkpoint,
    stale_temp_entries,
)
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.full_writes import bytes_written
from rollout_service.protocol import (
    ACK_EXPIRY_S,
    MAX_CLOCK_SKEW_S,
    AcksCutShort,
    fresh_acks,
    list_acks,
    remove_expired_acks,
)
from rollout_service.sidecar.root_gate import RootUnresponsive

from .checkpoint_dtype import target_dtype
from .checkpoint_retention import (
    HiddenRemover,
    StepEntries,
    list_step_entries,
    newest_checkpoints,
    prune_checkpoints,
)
from .replica_wait import ReplicaWaiter, RootLooks

log = logging.getLogger(__name__)

T = TypeVar("T")

JOIN_PROGRESS_EVERY_S = 30.0
"""How often a sync waiting for the background one before it logs that it still waits."""
JOIN_POLL_S = 1.0
"""How often that wait looks at the background sync's progress."""
HAND_OFF_TENSORS = 2
"""Tensors drawn ahead of a foreground write (see :class:`_HandOff`)."""
WRITE_ALLOWANCE_BYTES_PER_S = 10e6
"""The slowest storage a background write is given time for: 10 MB/s (a 15 GB checkpoint: 25
minutes). Slower, and still writing, it is waited for all the same (see :func:`background_sync_bound_s`)."""
WRITE_ALLOWANCE_BASE_S = 60.0
"""Time every background write is given besides its bytes (opening, fsyncs, renames)."""
MAX_VERSIONS_KEPT = 1 << 16
"""How many of its newest versions a publisher remembers (``max_staleness`` looks that far back at most)."""
PRUNE_SKIPPED_LOG_EVERY_S = 600.0
"""How often the same reason to leave old checkpoints in place (acks not all read) is logged again."""


def background_sync_bound_s(sync_timeout_s: float, bytes_to_write: int) -> float:
    """How long a background sync may run before the next sync gives up waiting for it: its write
    at :data:`WRITE_ALLOWANCE_BYTES_PER_S` plus :data:`WRITE_ALLOWANCE_BASE_S`, then its wait for
    the replicas and its retention (``sync_timeout_s`` each: both give up on their own by then).

    Past it, the wait gives up only once nothing was written for ``sync_timeout_s`` (a write
    blocked in the storage: a hung NFS server); a write that is slow but moving is waited for.
    """
    return WRITE_ALLOWANCE_BASE_S + bytes_to_write / WRITE_ALLOWANCE_BYTES_PER_S + 2 * sync_timeout_s


@dataclass
class _BackgroundJob:
    """The sync job in flight (background, or foreground on its own thread), as its waiter watches it."""

    version: int
    bytes_to_write: int
    """What its write writes at most (0: not known); it decides its bound (:func:`background_sync_bound_s`)."""
    started: float
    """``time.monotonic()`` when it was submitted."""
    written_before: int
    """:func:`~rollout_service.full_writes.bytes_written` then."""
    written: int = 0
    """Bytes written since, when last looked at."""
    moved_at: float = 0.0
    """``time.monotonic()`` when that count last moved (at first, when the job started)."""
    write_done: bool = False
    """Its write has ended: the wait for the replicas and retention that follow write nothing and
    give up on their own (``sync_timeout`` each), so no bytes moving then says nothing."""
    abandoned: bool = False
    """A foreground job its caller stopped waiting for (Ctrl-C): the next sync waits only for its
    write to end (a step half written must not be left to a later one), and raises nothing of it."""

    def __post_init__(self) -> None:
        self.moved_at = self.moved_at or self.started

    def look(self, now: float) -> None:
        """Take in the bytes written so far."""
        written = bytes_written() - self.written_before
        if written != self.written:
            self.written, self.moved_at = written, now


@dataclass
class SyncRecord:
    """One finished sync: the version and its phase times in seconds."""

    version: int
    gather_s: float
    write_s: float
    wait_s: float
    total_s: float
    bytes: int
    background: bool
    pruned: int = 0
    kind: str = "full"
    full_bytes: int = 0
    """What a full checkpoint of this version is (``bytes`` of a delta is what was written)."""


class _TimedIterator:
    """Wraps the weight iterator to measure time spent producing tensors (the gather)."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it = iter(tensors)
        self.seconds = 0.0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0

    def drain(self) -> None:
        """Consume what is left (gathers are collective: other processes wait for them)."""
        for _ in self:
            pass

    def hand_off(self, replacement: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Read ``replacement`` from now on; return what was read so far (to be read elsewhere)."""
        source, self._it = self._it, replacement
        return source


_END = object()
"""The hand-off's last item: the weights are all drawn."""


class _HandOff:
    """The weights drawn on the calling thread (the gather is collective: it stays there) and
    written by a foreground job on its own thread, through a queue of :data:`HAND_OFF_TENSORS`."""

    def __init__(self, job: _BackgroundJob) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(HAND_OFF_TENSORS)
        self._job = job
        self.abandoned = threading.Event()
        """Set by the calling thread when it stops drawing before the end (an error, Ctrl-C)."""

    def consume(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(The job's thread.) The weights as the calling thread hands them over. Each one taken
        is progress (a slow gather is no blocked write) and adds its bytes to the job's bound."""
        while True:
            try:
                item = self._queue.get(timeout=JOIN_POLL_S)
            except queue.Empty:
                if self.abandoned.is_set():
                    raise RuntimeError("the sync was given up on the calling thread: no more weights come") from None
                continue
            if item is _END:
                return
            tensor = item[1]
            self._job.bytes_to_write += tensor.numel() * tensor.element_size()
            self._job.moved_at = time.monotonic()
            yield item

    def put(self, item: Any, give_up: Callable[[], bool]) -> bool:
        """(The calling thread.) Hand ``item`` over once there is room; False when ``give_up()``
        said so first (asked every :data:`JOIN_POLL_S` while the queue is full)."""
        while True:
            try:
                self._queue.put(item, timeout=JOIN_POLL_S)
                return True
            except queue.Full:
                if give_up():
                    return False


def _in_daemon_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn()`` on a new daemon thread (one blocked for good in the storage holds up no exit)."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def cast_on_device(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cast floating tensors to ``dtype`` where they are (on the GPU), before any copy to the CPU.

    The writer copies each tensor to the CPU and then casts; done here first, a float32 -> bfloat16
    sync moves half the bytes over PCIe. CPU tensors and tensors already in ``dtype`` pass
    through untouched (the writer then does what it always did).
    """
    for name, t in tensors:
        if dtype is not None and t.device.type != "cpu" and t.is_floating_point() and t.dtype != dtype:
            t = t.detach().to(dtype)
        yield name, t


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to the CPU (a CPU tensor as it is)."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")


class CheckpointPublisher:
    """Versioned publication of the policy under a checkpoint root, then a wait for the replicas."""

    def __init__(
        self,
        root: Path | str,
        waiter: ReplicaWaiter,
        *,
        config: dict[str, Any],
        dtype: str | None,
        max_shard_bytes: int,
        keep: int | None,
        sync_timeout_s: float,
        heartbeat_max_age_s: float,
        base_model: str | None = None,
        delta: DeltaCheckpointWriter | None = None,
    ) -> None:
        self.root = Path(root).absolute()  # (manifests read under a relative root were never found)
        self.waiter = waiter
        self.config = config
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.keep = keep
        self.sync_timeout_s = sync_timeout_s
        self.heartbeat_max_age_s = heartbeat_max_age_s
        self.base_model = base_model
        self.delta = delta
        """Publishes deltas against the last version (None: every checkpoint is full)."""
        self.run_id = new_run_id()
        """This run's lineage id, in every manifest it publishes; the waiter counts only
        replicas that serve a checkpoint of this run (a reused root cannot fool it)."""
        if hasattr(waiter, "run_id"):
            waiter.run_id = self.run_id
        self.latest_version: int | None = None
        """The newest version this publisher started publishing."""
        self.confirmed_version: int | None = None
        """The newest version every expected replica acknowledged."""
        self.first_version: int | None = None
        self._started: collections.deque[int] = collections.deque(maxlen=MAX_VERSIONS_KEPT)
        """The versions this publisher started publishing, oldest first (the newest ones)."""
        self._records: list[SyncRecord] = []
        self._records_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[SyncRecord] | None = None
        self._job: _BackgroundJob | None = None
        """What :attr:`_future` runs (its version, how far its write got)."""
        self._swept_at: float | None = None
        """When :meth:`_sweep_leftovers` last looked (the start's clean-up counts as none)."""
        self._prune_skipped_said: float | None = None
        """When the log last said retention is skipped (acks not all read); None: it is not."""
        self._torch_dtype = target_dtype(dtype)
        self._pinned: dict[str, torch.Tensor] = {}
        """Pinned host buffers of the last background snapshot, reused by the next one."""
        self._looks = RootLooks(self.root)
        """Looks at the root (its listing, its identity) that give up after ``sync_timeout_s``."""
        self._remover = HiddenRemover()
        """Removes deleted steps' files beside training, not in a look at the root: a slow removal
        would otherwise make the next sync's look find the root "not answering"."""
        self._root_identity, stale = self._on_root(self._prepare_root, "making it and listing stale temporary entries")
        """(device, inode) of the root as it was at the start: a root unmounted or replaced since is
        not published into (a folder at the same path is not what the replicas watch)."""
        for entry in stale:  # removed beside training: a slow removal is no root that does not answer
            log.info("removing %s, a temporary entry left by a writer that was killed", entry)
            self._remover(entry, entry.name)

    def _on_root(self, look: Callable[[], T], what: str) -> T:
        """``look()``, given up on after ``sync_timeout_s`` (``RootUnresponsive`` naming the root):
        on a hung network file system a read blocks in the kernel for good."""
        return self._looks.run(lambda deadline: look(), time.monotonic() + self.sync_timeout_s, what)

    def _prepare_root(self) -> tuple[tuple[int, int], list[Path]]:
        """Make the root, list killed writers' leftovers, and hold the root open: a FUSE file
        system (sshfs) numbers a folder's inode afresh once the kernel has dropped it from its
        cache (memory pressure on a training node), so the same root would look replaced at the
        next publish; a folder held open stays cached, and keeps its number."""
        self.root.mkdir(parents=True, exist_ok=True)  # made once; if it vanishes later, publishing stops
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # Held for the publisher's life, closed when it is collected (also when this look fails or
        # was given up on); not by close(): ``evaluate()`` after ``train()`` publishes again.
        weakref.finalize(self, os.close, fd)
        stale = stale_temp_entries(self.root)
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino), stale

    def next_version(self) -> int:
        """One above both the last version used and the newest checkpoint published under the root.

        Checkpoints of any run count (a restarted trainer is a new run, and versions only grow),
        but only published ones (:func:`newest_checkpoints`): a stray entry named like a step does
        not move the numbering, and its name is skipped rather than published over. Raises
        ``RuntimeError``, saying what to do, when no step number is left.
        """
        try:
            entries, newest = self._on_root(self._newest, "listing its checkpoints")
        except CheckpointError as exc:  # the root cannot be listed whole (too_many_entries)
            if self.latest_version is None:
                raise RuntimeError(f"cannot number the first checkpoint of this run: {exc}") from None
            log.warning("numbering on from version %d without a listing of the root: %s", self.latest_version, exc)
            return self.latest_version + 1  # a name already taken is refused by the publish itself
        if newest is not None and self.latest_version is not None and newest.step > self.latest_version:
            self._refuse_a_second_writer(newest)
        version = max(0, self.latest_version or 0, newest.step if newest else 0) + 1
        taken = {c.step for c in entries.published + entries.odd}
        while version in taken:
            version += 1
        if version > MAX_STEP:
            raise RuntimeError(self._no_step_left(newest))
        return version

    def _refuse_a_second_writer(self, newer: PublishedCheckpoint) -> None:
        """Raise ``RuntimeError`` if ``newer`` (a step above every version this run started, or the
        step this run found taken when publishing it) was published by another run: two trainers
        publishing into one root take turns at the newest step, and every replica serves whichever
        is newest, so each run's rollouts would come from the other's weights. Once this run has
        published, no other run may publish above it. (A listing served from a network file
        system's cache can miss the other run's newest step: the publish then finds its name taken.)

        A manifest that cannot be read now passes (the caller goes on as without this check)."""
        try:
            run_id = self._on_root(lambda: Manifest.load(newer.path, root=self.root).run_id, "reading a manifest")
        except (CheckpointError, OSError, RootUnresponsive):
            return
        if run_id == self.run_id:
            return
        raise RuntimeError(
            f"{newer.path} was published by another run (run id {run_id or 'not recorded'}), not by this run"
            f" (run id {self.run_id}): two trainers are publishing into the"
            f" checkpoint root {self.root}, and the replicas serve whichever published last, so neither"
            " run's rollouts come from its own weights. Stop the other trainer, or give each run its own"
            " checkpoint_path, and restart this run"
        )

    def _refuse_a_hidden_step(self, taken: PublishedCheckpoint) -> None:
        """Raise ``RuntimeError`` if ``taken``, the name this run's first checkpoint was numbered
        onto, holds another run's published step: the root's listing did not show it when this run
        numbered (a network file system serves listings from its cache for a while, e.g. a run that
        died on another host just before). Nothing of this run was published; a restart numbers
        above it. A manifest that cannot be read passes (the caller raises the write's error)."""
        try:
            run_id = self._on_root(lambda: Manifest.load(taken.path, root=self.root).run_id, "reading a manifest")
        except (CheckpointError, OSError, RootUnresponsive):
            return
        raise RuntimeError(
            f"{taken.path} was published by another run (run id {run_id or 'not recorded'}), which the"
            f" listing of the checkpoint root {self.root} did not show when this run (run id {self.run_id})"
            " numbered its first checkpoint: a network file system may serve a folder's listing from its"
            " cache for a while. Nothing of this run was published. Restart the run (it numbers above that"
            " step); if the other run is still publishing, stop it or give each run its own checkpoint_path"
        )

    def _newest(self) -> tuple[StepEntries, PublishedCheckpoint | None]:
        entries = list_step_entries(self.root)
        return entries, next(iter(newest_checkpoints(self.root, entries.published, 1)), None)

    def _no_step_left(self, newest: PublishedCheckpoint | None) -> str:
        """Why no version is left to publish, and what to do."""
        if newest is not None and newest.step == MAX_STEP:
            why = f"{newest.path} is a published checkpoint with the largest step the format can name"
        elif self.latest_version == MAX_STEP:
            why = f"this run published {step_dir_name(MAX_STEP)}, the largest step the format can name"
        else:
            why = f"every step name up to {step_dir_name(MAX_STEP)} is taken under {self.root}"
        return (
            f"no checkpoint version is left to publish: {why}. Publish into a fresh checkpoint root"
            " (or move the old checkpoints out of this one, and any entry named like a step that is"
            " not a checkpoint) and restart the run"
        )

    def publish(
        self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], *, background: bool
    ) -> Future[SyncRecord]:
        """Take in ``tensors`` now, then write ``version`` and wait for the replicas in a job.

        The job runs on this thread (``background=False``: the Future is done on return) or on
        the worker thread. The iterator is always exhausted, also when anything fails, so that
        processes taking part in collective gathers are not left waiting.
        """
        self.join()
        timed = _TimedIterator(tensors)
        t0 = time.perf_counter()
        try:
            write, streams, bytes_to_write = self._take_in(timed, background)
        except BaseException:
            timed.drain()
            raise
        taken_s = time.perf_counter() - t0
        streamed = timed if streams else None
        return self._submit(
            version, write, taken_s=taken_s, streamed=streamed, background=background, bytes_to_write=bytes_to_write
        )

    def publish_prepared(
        self,
        version: int,
        write: Callable[[int], PublishResult],
        *,
        prepared_s: float,
        background: bool = False,
    ) -> Future[SyncRecord]:
        """Publish ``version`` with a writer prepared by the caller, as :meth:`publish` does the weights.

        ``write(version)`` publishes the checkpoint (any kind: an adapter, ...) from what the caller
        took in, which took ``prepared_s`` seconds (recorded as the gather); then the job wakes and
        waits for the replicas, prunes and records the sync, on this thread or (``background=True``)
        on the worker thread, in which case what ``write`` reads must not change until it is done.
        """
        self.join()
        return self._submit(version, write, taken_s=prepared_s, streamed=None, background=background)

    def _submit(
        self,
        version: int,
        write: Callable[[int], PublishResult],
        *,
        taken_s: float,
        streamed: _TimedIterator | None,
        background: bool,
        bytes_to_write: int = 0,
    ) -> Future[SyncRecord]:
        """The one publish path: ``version`` becomes the latest, then a job writes it with ``write``,
        waits for the replicas and records the sync. ``streamed``: the weights the writer draws
        (their drawing time is the gather; drawn to their end whatever happens, also when the
        write never starts); else ``taken_s`` was the gather, spent before the job.
        ``bytes_to_write``: what the write writes at most, if known (bounds a background job's wait)."""
        self._start(version)

        watched: list[_BackgroundJob] = []
        """The job's watch record once submitted in the background: its write's end is marked there."""

        def job() -> SyncRecord:
            t1 = time.perf_counter()
            try:
                result = self._write_under_root(write, version)
                if watched:  # what follows (the replicas' wait, retention) gives up on its own
                    watched[0].write_done = True
            finally:
                if streamed is not None:
                    streamed.drain()
            spent = time.perf_counter() - t1
            gather_s = streamed.seconds if streamed is not None else taken_s
            write_s = max(0.0, spent - streamed.seconds) if streamed is not None else spent
            return self._finish(
                version,
                gather_s=gather_s,
                write_s=write_s,
                result=result,
                started=t1,
                before_s=0.0 if streamed is not None else taken_s,
                background=background,
            )

        self._job = _BackgroundJob(version, bytes_to_write, time.monotonic(), bytes_written())
        watched.append(self._job)
        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sync")
            self._future = self._pool.submit(job)
            return self._future
        # In the foreground too the job runs on a thread of its own, the caller watching it as the
        # next sync watches a background one: a write blocked in the storage (a hung NFS server)
        # ends the wait with RootUnresponsive instead of hanging the trainer without a word. The
        # weights are still drawn here (collective gathers), handed to the job's write.
        record = self._job
        handoff = _HandOff(record) if streamed is not None else None
        source = streamed.hand_off(handoff.consume()) if streamed is not None and handoff is not None else None
        future = self._future = _in_daemon_thread(job, f"checkpoint-sync-{version}")
        try:
            if source is not None and handoff is not None:
                try:
                    self._pump(source, handoff, future, record)
                except Exception as exc:  # the gather failed: the write, without its weights, fails at once
                    if not isinstance(exc, RootUnresponsive):
                        with contextlib.suppress(RootUnresponsive):  # (else it stays pending: the next sync waits)
                            self._wait_for(future)
                            self._future = self._job = None
                    raise
            self._wait_for(future)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: the caller stops waiting here
                record.abandoned = True
                if handoff is not None:
                    handoff.abandoned.set()  # a write still waiting for weights fails at once
            raise
        self._future = self._job = None
        return future

    def _pump(
        self,
        source: Iterator[tuple[str, torch.Tensor]],
        handoff: _HandOff,
        future: Future[SyncRecord],
        job: _BackgroundJob,
    ) -> None:
        """Draw the weights here and hand them to the foreground job's write, each one copied to
        the host here (cast on its device first): a tensor on a GPU is held no longer than when the
        writer drew it itself. A job that ended (failed) takes no more, and one whose write is
        blocked in the storage raises ``RootUnresponsive`` (:meth:`_check_stuck`); the rest of the
        weights are drawn all the same (gathers are collective: other processes wait for them)."""

        def give_up() -> bool:
            self._check_stuck(job)
            return future.done()

        try:
            for name, tensor in cast_on_device(source, self._torch_dtype):
                if not handoff.put((name, _to_host(tensor)), give_up):
                    break
            else:
                handoff.put(_END, give_up)
                return
        except BaseException:
            handoff.abandoned.set()
            with contextlib.suppress(Exception):
                for _ in source:
                    pass
            raise
        handoff.abandoned.set()
        for _ in source:
            pass

    def _write_under_root(self, write: Callable[[int], PublishResult], version: int) -> PublishResult:
        """``write(version)``, into the root this publisher started with: a root that vanished
        (deleted, unmounted) is not made again on the local disk under its mount point, and a
        storage error says where, which version, and what to do."""
        try:
            now = self._on_root(lambda: _identity(self.root), "checking it is still there")
        except FileNotFoundError:
            now = None
        if now != self._root_identity:
            raise FileNotFoundError(
                errno.ENOENT,
                f"the checkpoint root {self.root} is {'gone' if now is None else 'another folder than at the start'}"
                f" (deleted, replaced, or its volume unmounted); version {version} was not published. Mount or"
                " restore it and restart the run (replicas watch that volume, not a folder made again on this disk)",
            )
        try:
            return write(version)
        except FileExistsError:
            taken = PublishedCheckpoint(version, self.root / step_dir_name(version))
            if self.first_version is not None and version > self.first_version:
                self._refuse_a_second_writer(taken)
            elif version == self.first_version:
                self._refuse_a_hidden_step(taken)
            raise
        except OSError as exc:
            if exc.errno is None:  # not from the storage: nothing to add
                raise
            keeps = (
                "keep fewer checkpoints (keep_checkpoints); retention also keeps every step a live replica"
                " serves or loads"
                + (
                    ", and every step of the newest delta chain back to its full step whatever keep_checkpoints"
                    " says (a smaller checkpoint_full_every shortens the chain; the next publish after a failed"
                    " one is a full checkpoint, the largest)"
                    if self.delta is not None
                    else ""
                )
            )
            hint = {
                errno.ENOSPC: f"free space there, or {keeps}",
                errno.EDQUOT: f"the disk quota is spent: free space there, or {keeps}",
                errno.EROFS: "the root is read-only: mount it writable",
                errno.EACCES: "the trainer may not write there: fix the root's permissions",
                errno.EIO: "the storage reported an I/O error: check it",
            }.get(exc.errno or 0, "check the storage")
            raise type(exc)(
                exc.errno or errno.EIO,
                f"publishing version {version} under {self.root} failed: {exc.strerror or exc}; nothing of it"
                f" was published ({hint})",
            ) from exc

    def publish_and_wait(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncRecord:
        """Publish ``version`` and wait for the replicas, on this thread; raise what failed."""
        self.raise_if_failed()
        return self.publish(version, tensors, background=False).result()

    def publish_in_background(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Take in ``tensors`` now, write and wait in the worker; return the take-in time."""
        self.raise_if_failed()
        t0 = time.perf_counter()
        self.publish(version, tensors, background=True)
        return time.perf_counter() - t0

    def _take_in(self, timed: _TimedIterator, background: bool) -> tuple[Callable[[int], PublishResult], bool, int]:
        """What the job needs, taken from the weights now: (write(version), whether it streams, the
        bytes it writes at most when known, else 0)."""
        common: dict[str, Any] = dict(
            config=self.config, max_shard_bytes=self.max_shard_bytes, base_model=self.base_model, run_id=self.run_id
        )
        if self.delta is not None:
            delta = self.delta
            delta.absorb(
                cast_on_device(timed, self._torch_dtype), dtype=self.dtype, max_shard_bytes=self.max_shard_bytes
            )
            return (lambda version: delta.write(self.root, version, **common)), False, delta.held_bytes
        if background:
            snapshot = self._snapshot(iter(timed))

            def write_snapshot(version: int) -> PublishResult:
                try:
                    return publish_checkpoint(self.root, version, snapshot, dtype=self.dtype, **common)
                finally:
                    snapshot.clear()

            return write_snapshot, False, sum(t.numel() * t.element_size() for _, t in snapshot)
        return (
            (
                lambda version: publish_checkpoint(
                    self.root, version, cast_on_device(timed, self._torch_dtype), dtype=self.dtype, **common
                )
            ),
            True,
            0,
        )

    def _snapshot(self, source: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A CPU copy of every tensor, already in the checkpoint dtype (one copy, never two).

        A GPU tensor is cast on the GPU, then copied into a pinned host buffer kept for the next
        sync (same name, shape and dtype: reused, no new allocation). A CPU tensor is cast (which
        copies) or, when already in the checkpoint dtype, cloned: the live parameter changes
        while the worker writes.
        """
        want = self._torch_dtype
        snapshot: list[tuple[str, torch.Tensor]] = []
        pinned: dict[str, torch.Tensor] = {}
        copied_from_gpu = False
        for name, t in source:
            t = t.detach()
            floating = t.is_floating_point()
            if t.device.type == "cpu":
                if want is not None and floating and t.dtype != want:
                    copy = t.to(want)
                else:
                    copy = t.clone()
            else:
                if want is not None and floating and t.dtype != want:
                    t = t.to(want)  # on the device: half the bytes over PCIe for fp32 -> bf16
                buf = self._pinned.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                buf.copy_(t, non_blocking=t.is_cuda)
                copied_from_gpu = copied_from_gpu or t.is_cuda
                pinned[name] = buf
                copy = buf
            snapshot.append((name, copy))
        if copied_from_gpu:
            torch.cuda.synchronize()
        self._pinned = pinned
        return snapshot

    def join(self) -> None:
        """Wait for the background job (if any), then raise its error (if any).

        The wait logs its progress every :data:`JOIN_PROGRESS_EVERY_S` (the version, the time
        waited, the bytes written), and raises ``RootUnresponsive`` naming the version and the root
        once the job ran past :func:`background_sync_bound_s` and wrote nothing for
        ``sync_timeout_s``: its write is blocked in the storage, which no one can interrupt.

        Ctrl-C (or a SIGTERM turned into one) while waiting propagates, and the job is still the
        pending one (so it is after ``RootUnresponsive``): the next :meth:`publish` waits for it
        again before it takes anything in, so a version is never taken in while the job before it
        still reads the held copy."""
        future = self._future
        if future is not None:
            self._wait_for(future)
            job = self._job
            if job is not None and job.abandoned:  # its caller gave up on it: its write has ended
                self._future = self._job = None
                if future.done() and not future.cancelled() and future.exception() is not None:
                    log.warning("the interrupted sync of version %d failed: %s", job.version, future.exception())
                return
            with contextlib.suppress(CancelledError):
                future.exception()
        self.raise_if_failed()

    def _wait_for(self, future: Future[SyncRecord]) -> None:
        """Wait until ``future`` is done, logging progress; ``RootUnresponsive`` when it is stuck (see :meth:`join`)."""
        job = self._job
        next_report = time.monotonic() + JOIN_PROGRESS_EVERY_S
        while not wait([future], timeout=JOIN_POLL_S).done:
            if job is None:
                continue
            if job.abandoned and (job.write_done or future.done()):
                return  # what is left (the replicas' wait) no one waits for
            now = time.monotonic()
            self._check_stuck(job)
            if now >= next_report:
                log.info(
                    "waiting for the sync of version %d to finish: %.0f s so far, %s",
                    job.version,
                    now - job.started,
                    _written(job),
                )
                next_report = now + JOIN_PROGRESS_EVERY_S

    def _check_stuck(self, job: _BackgroundJob) -> None:
        """Raise ``RootUnresponsive`` when ``job`` ran past :func:`background_sync_bound_s` and its
        write wrote nothing for ``sync_timeout_s``: it is blocked in the storage."""
        now = time.monotonic()
        job.look(now)
        waited, still = now - job.started, now - job.moved_at
        bound = background_sync_bound_s(self.sync_timeout_s, job.bytes_to_write)
        if waited > bound and still > self.sync_timeout_s and not job.write_done:
            raise RootUnresponsive(
                f"the checkpoint root {self.root} is not answering: the sync of version"
                f" {job.version} has written nothing for {still:.0f} s ({_written(job)} in {waited:.0f} s, past"
                f" the {bound:.0f} s it may take): its write is blocked in the storage. Check the root's file"
                f" system on the trainer's machine (NFS server, mount: does `ls {self.root}` return?) and"
                " restart the run once it answers; raise sync_timeout if it is only slow"
            )

    def close(self) -> None:
        """Wait for the background job and stop the worker thread (raises the job's error), then
        for the removal of deleted steps' files, at most ``sync_timeout_s`` (what is left stays
        under hidden names, removed by a later trainer). A job stuck in the storage
        (``RootUnresponsive``) is left to its thread, and so is one whose wait Ctrl-C (or
        SystemExit) cut short: nothing more is waited for then."""
        stuck = False
        try:
            self.join()
        except RootUnresponsive:
            stuck = True
            raise
        except BaseException as exc:
            stuck = not isinstance(exc, Exception)
            raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=not stuck)
                self._pool = None
            if self.delta is not None and not stuck:  # its encode threads (the held copy stays)
                self.delta.close()
            left = 0 if stuck else self._remover.join(self.sync_timeout_s)
            if left:
                log.warning(
                    "%d deleted old checkpoint(s) under %s are still being removed after %g s; they stay"
                    " under hidden names (.tmp-deleting-*), which a later trainer removes",
                    left,
                    self.root,
                    self.sync_timeout_s,
                )

    @property
    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def raise_if_failed(self) -> None:
        job = self._job
        if job is not None and job.abandoned:  # interrupted (Ctrl-C): its write ends before anything goes on
            self.join()
            return
        future = self._future
        if future is None or not future.done():
            return
        self._future = self._job = None
        error = future.exception()
        if error is not None:
            log.error("background sync failed: %s", error)
            raise RuntimeError(f"the background checkpoint sync failed: {error}") from error

    def drain_records(self) -> list[SyncRecord]:
        with self._records_lock:
            records, self._records = self._records, []
        return records

    def _start(self, version: int) -> None:
        self.latest_version = version
        self._started.append(version)
        if self.first_version is None:
            self.first_version = version

    def version_back(self, publishes: int) -> int | None:
        """The version this publisher started ``publishes`` publishes before the newest one (its
        first when it has published fewer; None before any). Versions can skip numbers (a name
        taken by a stray entry, another run's step), so this is not ``latest_version - publishes``."""
        if not self._started:
            return None
        if publishes < len(self._started):
            return self._started[-1 - publishes]
        return self.first_version

    def _finish(
        self,
        version: int,
        *,
        gather_s: float,
        write_s: float,
        result: PublishResult,
        started: float,
        before_s: float,
        background: bool,
    ) -> SyncRecord:
        """Wake and wait for the replicas, prune, record; ``started``/``before_s`` give the total time."""
        self.waiter.notify(version)
        t_wait = time.perf_counter()
        self.waiter.wait(version, self.sync_timeout_s)
        wait_s = time.perf_counter() - t_wait
        self.confirmed_version = max(self.confirmed_version or 0, version)
        pruned = self._prune(version)
        self._sweep_leftovers()
        record = SyncRecord(
            version=version,
            gather_s=gather_s,
            write_s=write_s,
            wait_s=wait_s,
            total_s=before_s + (time.perf_counter() - started),
            bytes=result.total_bytes,
            background=background,
            pruned=len(pruned),
            kind=result.kind,
            full_bytes=result.full_bytes or result.total_bytes,
        )
        with self._records_lock:
            self._records.append(record)
        log.info(
            "sync version %d (%s): gather %.3f s, write %.3f s (%.1f MB%s), replicas %.3f s%s",
            version,
            result.kind,
            gather_s,
            write_s,
            result.total_bytes / 1e6,
            f" of {record.full_bytes / 1e6:.1f} MB full" if result.kind == "delta" else "",
            wait_s,
            " (background)" if background else "",
        )
        return record

    def _sweep_leftovers(self) -> None:
        """Every ``LEFTOVER_SWEEP_S``, hand the root's stale temporary entries (a killed writer's
        work folder an hour old, as at the start) to the background remover. A trainer killed
        mid-publish in a container leaves one that its restarted successor cannot tell dead (a
        new PID namespace) and keeps at the start: without this it stayed for the whole run, one
        model copy per crash. Given up on after ``sync_timeout_s``, like every look at the root."""
        now = time.monotonic()
        if self._swept_at is not None and now - self._swept_at < LEFTOVER_SWEEP_S:
            return
        self._swept_at = now
        try:
            stale = self._on_root(lambda: stale_temp_entries(self.root), "looking for stale temporary entries")
        except (OSError, RootUnresponsive) as exc:
            log.warning("could not look for stale temporary entries under %s: %s", self.root, exc)
            return
        for entry in stale:
            log.info("removing %s, a temporary entry left by a writer that was killed over an hour ago", entry)
            self._remover(entry, entry.name)

    def _prune(self, newest: int) -> list[int]:
        """Delete checkpoints past ``keep`` that no replica needs, given up on after
        ``sync_timeout_s`` (a hung root leaves them for the next publish, never stalls training)."""
        if self.keep is None:
            return []
        keep = self.keep

        def prune() -> list[int]:
            # What the replicas still need: unknown (the acks unreadable, or not all read) means
            # nothing is pruned. The acks of replicas gone for a day go first (also when the
            # folder was not read whole: what was read of it shrinks).
            listing = list_acks(self.root)
            gone = remove_expired_acks(self.root, listing.acks, now=time.time())
            if gone:
                log.info(
                    "removed the ack files of %d replica(s) not heard from for %.0f h: %s",
                    len(gone),
                    ACK_EXPIRY_S / 3600,
                    ", ".join(gone[:10]) + (", ..." if len(gone) > 10 else ""),
                )
            if listing.cut_short is not None:
                raise AcksCutShort(listing.cut_short)
            protected = {newest} | self.waiter.protected_versions()
            # (a replica whose clock runs behind this host's looks older than it is: allow for it)
            recent_s = self.heartbeat_max_age_s + MAX_CLOCK_SKEW_S
            for ack in fresh_acks(listing.acks, now=time.time(), max_age_s=recent_s).values():
                protected.update(s for s in (ack.get("loaded_step"), ack.get("loading_step")) if _is_step(s))
            return prune_checkpoints(self.root, keep, protected, remove=self._remover)

        try:
            pruned = self._on_root(prune, "deleting old checkpoints")
        except AcksCutShort as exc:
            self._skip_pruning(str(exc))
            return []
        except Exception as exc:  # retention is best effort: it never ends training
            log.warning(
                "could not prune old checkpoints under %s: %s: %s (tried again at the next publish;"
                " if this repeats, the root fills: check it)",
                self.root,
                type(exc).__name__,
                exc,
            )
            return []
        if self._prune_skipped_said is not None:
            log.info("old checkpoints under %s are deleted again: every ack was read", self.root)
            self._prune_skipped_said = None
        return pruned

    def _skip_pruning(self, why: str) -> None:
        """Log that no old checkpoint was deleted because the acks were not all read (``why``):
        a replica whose ack was missed may serve any of them. Logged when first met, then at most
        every :data:`PRUNE_SKIPPED_LOG_EVERY_S` while it lasts (each publish meets it again)."""
        now = time.monotonic()
        if self._prune_skipped_said is not None and now - self._prune_skipped_said < PRUNE_SKIPPED_LOG_EVERY_S:
            log.debug("old checkpoints under %s left in place again: %s", self.root, why)
            return
        self._prune_skipped_said = now
        log.warning(
            "not deleting old checkpoints under %s: %s. A replica whose ack was not read may serve any of"
            " them, so retention waits until every ack is read (the root fills meanwhile; said again every"
            " %.0f s while it lasts)",
            self.root,
            why,
            PRUNE_SKIPPED_LOG_EVERY_S,
        )


def _is_step(value: Any) -> TypeGuard[int]:
    """Whether an ack's field holds a step number (an int, not a bool: JSON ``true`` is no step)."""
    return isinstance(value, int) and not isinstance(value, bool)


LEFTOVER_SWEEP_S = 600.0
"""How often a publish also looks for killed writers' temporary entries an hour old (they are
removed by age: a look every ten minutes finds each within 70 minutes)."""


def _written(job: _BackgroundJob) -> str:
    """How far a background job's write got, for a message."""
    of = f" of at most {job.bytes_to_write / 1e6:.1f} MB" if job.bytes_to_write else ""
    return f"{job.written / 1e6:.1f} MB written{of}"


def _identity(path: Path) -> tuple[int, int]:
    """(device, inode) of a folder: another after an unmount (the mount point's own folder) or a
    re-creation. ``FileNotFoundError`` when it is gone, ``NotADirectoryError`` when not a folder."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"the checkpoint root {path} is not a folder")
    return st.st_dev, st.st_ino
