"""Publishing versions as deltas: only the bytes that changed since the last published version.

:class:`DeltaCheckpointWriter` keeps **one CPU copy of the last published version's bytes**
(in the checkpoint dtype: for a bf16 7B model, 14 GB of host RAM) and never a second one:
each new tensor is XORed with its copy part by part (16 MiB, one zstd frame each: a big
tensor runs on several threads), the XOR is compressed with zstd on a thread pool while the
next tensor is gathered, the copy is updated in place, and each updated part is hashed into
the digests a delta's manifest needs while it is still in cache (:class:`_LayoutDigests`).
A publish is then either

- a **delta** (``kind: delta``, see :mod:`~rollout_service.checkpoint_format`): the
  compressed XORs of the changed tensors plus, for every tensor and every shard of the full
  checkpoint it stands for, the digest of the bytes a full publish would have written; or
- a **full** checkpoint, written from the copy by :func:`publish_checkpoint`: for the first
  version, every ``full_every`` versions, after a restart (nothing in memory), when names,
  shapes, dtypes or their order change, when the previous version is no longer published as
  it was, when an earlier publish failed, when a delta would exceed ``max_ratio`` of the
  full size, when its manifest (which lists every tensor) would be larger than readers read
  (``MAX_MANIFEST_BYTES``: a model of ~55,000 tensors or more), and (with ``costs``,
  :mod:`~rollout_service.delta_choice`) while full publishes measure faster than deltas on this
  storage.

The work is split in two so that a trainer can gather in the foreground and write in the
background: :meth:`absorb` consumes the weights (the collective part), :meth:`write` writes
(and must finish before the next :meth:`absorb`). :meth:`publish` does both.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import delta_codec
from .checkpoint_format import (
    CONFIG_NAME,
    DEFAULT_DELTA_MAX_RATIO,
    DEFAULT_FULL_EVERY,
    DTYPE_SIZES,
    FILE_NAME_CHARS,
    FLOAT_DTYPES,
    INDEX_NAME,
    MAX_CHAIN_FRAMES,
    MAX_CHAIN_LENGTH,
    MAX_CHAIN_NAME_CHARS,
    MAX_CHAIN_TENSORS,
    CheckpointError,
    DeltaInfo,
    DeltaTensor,
    FileEntry,
    Manifest,
    normalize_dtype,
    step_dir_name,
)
from .checkpoint_writer import (
    _TAG_TO_TORCH,
    _TORCH_TO_TAG,
    DEFAULT_MAX_SHARD_BYTES,
    MANIFEST_TIME_SLACK,
    MAX_MANIFEST_BYTES,
    PublishRefused,
    PublishResult,
    ShardPlanner,
    _prepare,
    _write_shard,
    atomic_step_dir,
    check_run_id,
    check_tensor_dtype,
    check_tensor_name,
    config_text,
    count_non_finite_bytes,
    duplicate_refusal,
    file_entry,
    index_json,
    new_manifest,
    non_finite_refusal,
    publish_checkpoint,
    shard_file_names,
    shard_prefix,
    write_manifest,
    write_small,
)
from .delta_choice import PublishCosts
from .digest import format_digest, new_hasher
from .finite import count_non_finite
from .ordered_digests import OrderedDigests

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """The last published bytes of one tensor."""

    tag: str
    shape: tuple[int, ...]
    data: np.ndarray
    digest: str
    """Of ``data``; empty until a delta needs it (taken while encoding, see :class:`_LayoutDigests`,
    or by ``_hash_held`` when the write hashes the copy)."""

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])


@dataclass
class Absorbed:
    """One version taken in by :meth:`DeltaCheckpointWriter.absorb`, not yet written."""

    delta: bool
    """Still a delta candidate (same layout as the base)."""
    blobs: dict[str, bytearray]
    frames: dict[str, list[int]]
    """Per changed tensor, the compressed size of each frame of its blob (0: part unchanged)."""
    dtype: str | None
    seconds: float
    why_full: str = ""
    changed_bytes: int = 0
    auto_full: bool = False
    """Full only because full publishes measured faster (``costs``)."""
    probe: bool = False
    """A delta candidate only to measure deltas again (``costs``)."""
    too_large: bool = False
    """A delta candidate that passed ``max_ratio`` while encoding: written in full, measured as a
    delta (its encode was paid for)."""
    shard_digests: list[str] | None = None
    """For a delta, each shard's digest (of the bytes a full publish writes), hashed by the
    encode threads for ``max_shard_bytes`` (a write with other shards hashes the held copy)."""
    max_shard_bytes: int = 0


@dataclass
class _Base:
    step: int
    fingerprint: str
    chain_start: int
    deltas_since_full: int
    chain_fingerprint: str = ""
    """The fingerprint of the chain's full step (``step``'s own when it is full)."""
    between: tuple[int, ...] = ()
    """The deltas published between the full step and ``step``: a delta on ``step`` needs them all."""
    run_id: str = ""
    """The chain's run: a delta of another run is refused by readers (its base is another run's)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """The chain's shard plan: a delta's target shards are its base's (another size makes others)."""


@dataclass
class _DeltaPlan:
    """A delta's files and manifest, laid out before anything is written: the size of its
    manifest (:attr:`manifest_bytes`) decides whether it may be published at all."""

    shards: list[list[str]]
    """The tensors of each shard of the full checkpoint the delta stands for."""
    names: list[str]
    """Those shards' file names."""
    prefixes: list[bytes]
    """Those shards' headers (what a full publish writes first)."""
    delta_files: list[str | None]
    """Per shard, the delta file that holds its changed tensors' blobs (None: none changed)."""
    small: dict[str, bytes]
    """The index (sharded only) and the config, as written."""
    files: dict[str, FileEntry]
    """The delta's files; a delta file's digest is a stand-in until it is written."""
    target: dict[str, FileEntry]
    """The full checkpoint's files; a shard's digest is a stand-in until it is hashed."""
    tensors: dict[str, DeltaTensor]
    """Every tensor's entry; a digest not known yet is a stand-in until its shard is hashed."""
    fields: dict[str, Any]
    """The manifest's other fields (see :func:`~rollout_service.checkpoint_writer.new_manifest`)."""
    manifest_bytes: int = 0
    """The size of the manifest with the stand-ins (the real one differs by at most
    ``MANIFEST_TIME_SLACK``: every digest has the same length)."""


_UNKNOWN_DIGEST = format_digest(new_hasher())
"""A stand-in for a digest not computed yet when a manifest is measured (every digest has this length)."""


@dataclass
class DeltaStats:
    """What the last publish wrote, for logs and benchmarks."""

    kind: str = "full"
    why_full: str = ""
    tensors: int = 0
    changed_tensors: int = 0
    changed_bytes: int = 0
    full_bytes: int = 0
    written_bytes: int = 0
    encode_s: float = 0.0
    write_s: float = 0.0
    chain_length: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class DeltaCheckpointWriter:
    """Publishes each version as a delta against the previous one, or in full when it must."""

    def __init__(
        self,
        *,
        full_every: int = DEFAULT_FULL_EVERY,
        max_ratio: float = DEFAULT_DELTA_MAX_RATIO,
        threads: int | None = None,
        level: int = delta_codec.ZSTD_LEVEL,
        costs: PublishCosts | None = None,
        check_finite: bool = True,
    ):
        """``costs``: choose between delta and full by measured publish times (None: a delta
        whenever one is possible). ``check_finite``: refuse a version whose floating tensors
        hold NaN/Inf (:class:`~rollout_service.checkpoint_writer.PublishRefused` from
        :meth:`absorb`); False only to make checkpoints that readers must reject, in tests."""
        if not 1 <= full_every <= MAX_CHAIN_LENGTH + 1:
            raise ValueError(
                f"full_every must be between 1 (every checkpoint is full) and {MAX_CHAIN_LENGTH + 1} (the longest"
                f" delta chain a reader replays), got {full_every}"
            )
        if not 0 < max_ratio <= 1:
            raise ValueError(f"max_ratio must be in (0, 1], got {max_ratio}")
        self.full_every = full_every
        self.max_ratio = max_ratio
        self.level = level
        self.check_finite = check_finite
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._held: dict[str, _Held] = {}
        self._order: list[str] = []
        self._base: _Base | None = None
        self._why_no_base = "no previous version in memory (first publish or restart)"
        """The last version this writer published (what a delta applies to); None: write full."""
        self._absorbed: Absorbed | None = None
        self._pending_base: _Base | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._scratch = threading.local()
        """Per encode thread: its cast and XOR buffers and its compressor, kept across versions."""
        self.costs = costs
        self._manifest_floor: tuple[tuple[Any, ...], int] | None = None
        """(layout, bytes): the smallest delta manifest of that layout (see :meth:`_delta_manifest_floor`)."""
        self._said_full_is_faster = False
        """The log says full publishes measure faster (said once, until deltas win again)."""
        self.last = DeltaStats()

    def close(self) -> None:
        """Stop the encode threads (the held copy stays: a later publish may still use it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def held_bytes(self) -> int:
        """Host RAM held for the last version (one copy of the model in the checkpoint dtype)."""
        return sum(h.nbytes for h in self._held.values())

    def _longest_chain(self) -> int:
        """``full_every``, or fewer versions when a chain of this model's deltas would list more
        frame sizes, tensor entries or characters of names than a reader holds (``MAX_CHAIN_FRAMES``,
        ``MAX_CHAIN_TENSORS``: a 70B model's chain stops at ~500; ``MAX_CHAIN_NAME_CHARS``)."""
        frames = sum(-(-h.nbytes // delta_codec.CHUNK_BYTES) for h in self._held.values())
        by_frames = MAX_CHAIN_FRAMES // max(frames, 1)
        by_tensors = MAX_CHAIN_TENSORS // max(len(self._held), 1)
        names = sum(len(name) + 2 * FILE_NAME_CHARS for name in self._held)
        by_names = MAX_CHAIN_NAME_CHARS // max(names, 1)
        return max(1, min(self.full_every, 1 + min(by_frames, by_tensors, by_names)))

    def publish(
        self,
        root: Path | str,
        step: int,
        tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        config: dict[str, Any] | Path | str | None,
        dtype: str | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        base_model: str | None = None,
        run_id: str | None = None,
    ) -> PublishResult:
        """:meth:`absorb` then :meth:`write`."""
        self.absorb(tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return self.write(
            root, step, config=config, max_shard_bytes=max_shard_bytes, base_model=base_model, run_id=run_id
        )

    # --- taking in a version ----------------------------------------------------------------
    def absorb(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: str | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> Absorbed:
        """Consume every tensor (always to the end), update the held copy, encode the XORs and
        (for a delta, whose shards are the last version's) hash the shards a full publish with
        ``max_shard_bytes`` would write, each part as soon as its held bytes are updated.

        A version that readers would reject (a tensor name they cannot parse, see
        :func:`~rollout_service.checkpoint_writer.check_tensor_name`; with ``check_finite``, a
        floating tensor holding NaN/Inf, counted in each changed part while it is in cache) is
        refused here with :class:`~rollout_service.checkpoint_writer.PublishRefused`, before
        anything is written, after taking part in the rest of the gathers. A delta candidate's
        held copy is then put back to the last published version (the changed parts XORed with
        their frames again), so the next version is still a delta on what replicas hold; a
        version that was going to be full has overwritten the copy, and the next one is full."""
        t0 = time.perf_counter()
        target = normalize_dtype(dtype)
        self._absorbed = None
        base = self._base
        why_full = ""
        full_every = self._longest_chain()
        if base is None:
            why_full = self._why_no_base
        elif base.deltas_since_full + 1 >= full_every:
            why_full = f"a full checkpoint every {full_every} versions"
            if full_every < self.full_every:
                why_full += " (the longest chain of this model's deltas a reader holds)"
        else:
            floor = self._delta_manifest_floor(base, max_shard_bytes)
            if floor + MANIFEST_TIME_SLACK > MAX_MANIFEST_BYTES:
                why_full = _manifest_too_large(floor, len(self._order), "even with none changed")
        probe = auto_full = False  # auto_full: full only because full publishes measure faster
        if not why_full and self.costs is not None:
            choice = self.costs.choose()
            why_full, probe = choice.reason, choice.probe
            auto_full = bool(why_full)
        delta = not why_full
        why_no_base = self._why_no_base
        self._base = None  # until this version is written, nothing is a valid base
        self._why_no_base = "the previous publish did not complete (its version is no base)"
        old, old_order = self._held, self._order
        held: dict[str, _Held] = {}
        order: list[str] = []
        blobs: dict[str, bytearray] = {}
        frames: dict[str, list[int]] = {}
        changed = 0
        budget = self.max_ratio * sum(h.nbytes for h in old.values())
        """Compressed bytes past which the version is full (``write`` would refuse the delta):
        the encode stops holding blobs there, so a version where most bytes change never holds
        more than ``max_ratio`` of a second model copy in RAM. (A version refused after that, for
        NaN/Inf, cannot be undone from its frames: the next version is then full.)"""
        encoded = 0
        too_large = False
        pending: deque[tuple[str, list[Future[_Part]]]] = deque()
        hashing = _LayoutDigests(old_order, old, max_shard_bytes) if delta else None
        refusal: PublishRefused | None = None

        def settle(name: str, jobs: list[Future[_Part]]) -> None:
            nonlocal changed, refusal, encoded, delta, hashing, why_full, too_large
            results = [job.result() for job in jobs]
            parts = [part for part, _ in results]
            if any(part is not None for part in parts):
                held[name].digest = ""  # its held bytes changed: hashed again when written
                if delta:
                    blobs[name] = bytearray().join(part for part in parts if part is not None)
                    frames[name] = [0 if part is None else len(part) for part in parts]
                    changed += held[name].nbytes
                    encoded += len(blobs[name])
                if delta and encoded > budget and refusal is None and not any(c for _, c in results):
                    # (The held copy is the new version's either way. Not once the version is
                    # refused: the undo below needs the frames to give the next delta its base.)
                    delta, hashing, too_large = False, None, True
                    why_full = (
                        f"the delta passed checkpoint_delta_max_ratio {self.max_ratio:g} of the full size while"
                        f" encoding ({encoded / 1e6:.1f} MB by {name!r})"
                    )
                    blobs.clear()
                    frames.clear()
            bad = sum(count for _, count in results)
            if bad and refusal is None:
                h = held[name]
                refusal = non_finite_refusal(name, h.tag, h.nbytes // DTYPE_SIZES[h.tag], bad)

        source = iter(tensors)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="delta-encode")
        pool = self._pool
        try:
            for name, tensor in source:
                if refusal is not None:
                    continue  # refused: only take part in the rest of the gathers (collective)
                try:
                    if check_tensor_name(name) in held:
                        raise duplicate_refusal(name)
                    check_tensor_dtype(name, tensor)
                except PublishRefused as exc:
                    refusal = exc
                    continue
                tag, shape = _tag_after_prepare(tensor, target), tuple(tensor.shape)
                nbytes = DTYPE_SIZES[tag] * tensor.numel()
                prev = old.get(name)
                same = prev is not None and prev.tag == tag and prev.shape == shape
                if delta and not (same and len(order) < len(old_order) and old_order[len(order)] == name):
                    delta, hashing = False, None  # the parts submitted so far are still hashed: no one waits
                    why_full = f"the tensor layout changed at {name!r} (names, shapes, dtypes or order)"
                order.append(name)
                if delta:
                    assert prev is not None
                    held[name] = prev
                    pending.append((name, self._submit_encode(pool, name, tensor, prev, hashing)))
                else:
                    reuse = prev.data if prev is not None and prev.nbytes == nbytes else None
                    entry = _Held(tag, shape, _NO_BYTES, "")
                    held[name] = entry
                    pending.append((name, [pool.submit(self._copy_into, tensor, target, entry, reuse)]))
                while len(pending) > 2 * self.threads:
                    settle(*pending.popleft())
            while pending:
                settle(*pending.popleft())
        except BaseException:
            for _ in source:  # gathers are collective: take part in the rest
                pass
            for _, jobs in pending:
                for job in jobs:
                    job.cancel()
            self._held, self._order = {}, []
            raise
        if refusal is not None:
            self._held, self._order = {}, []
            self._why_no_base = "the previous version was refused, and the copy held of its base was overwritten"
            if delta:  # every held entry is the last version's, changed in place: change it back
                for name, blob in blobs.items():
                    _undo_frames(held[name], blob, frames[name])
                self._held, self._order = old, old_order
                self._base, self._why_no_base = base, why_no_base
            raise refusal
        if not order:
            raise ValueError("no tensors to publish: the iterable was empty")
        if delta and len(order) != len(old_order):
            delta, why_full = False, "the tensor layout changed (fewer tensors than the last version)"
        self._held, self._order = held, order
        if not delta:
            blobs, frames, changed = {}, {}, 0
        shard_digests = None
        if delta:  # still a delta: hashing was made at the start and never dropped
            assert hashing is not None
            shard_digests = hashing.finish(held)
        floats = {h.tag for h in held.values() if h.tag in FLOAT_DTYPES}
        self._pending_base = base
        self._absorbed = Absorbed(
            delta=delta,
            blobs=blobs,
            frames=frames,
            dtype=target or (floats.pop() if len(floats) == 1 else None),
            seconds=time.perf_counter() - t0,
            why_full=why_full,
            changed_bytes=changed,
            auto_full=auto_full,
            probe=probe,
            too_large=too_large,
            shard_digests=shard_digests,
            max_shard_bytes=max_shard_bytes,
        )
        return self._absorbed

    def _submit_encode(
        self, pool: ThreadPoolExecutor, name: str, tensor: torch.Tensor, prev: _Held, hashing: _LayoutDigests | None
    ) -> list[Future[_Part]]:
        """One encode job per :data:`~rollout_service.delta_codec.CHUNK_BYTES` part of the tensor."""
        flat = tensor.detach().reshape(-1)
        per_part = delta_codec.CHUNK_BYTES // DTYPE_SIZES[prev.tag]
        return [
            pool.submit(self._encode_part, flat, prev, first, min(per_part, flat.numel() - first), hashing, name, i)
            for i, first in enumerate(range(0, flat.numel(), per_part))
        ]

    def _encode_part(
        self,
        flat: torch.Tensor,
        prev: _Held,
        first: int,
        count: int,
        hashing: _LayoutDigests | None,
        name: str,
        part: int,
    ) -> _Part:
        """(On an encode thread.) Cast one part into this thread's buffer, XOR it with the held
        bytes, compress it into one frame, update the held bytes in place when they changed (a
        version allocates no model-sized memory: no page faults, and the held bytes stay the one
        copy), and offer them to ``hashing`` while they are still in cache. Returns the frame,
        or None when the part did not change, and (with ``check_finite``) the NaN/Inf values of
        a changed part (an unchanged one is the last version's: checked then). A CPU tensor
        already in the checkpoint dtype is read where it is, not copied into the buffer first
        (0.1-0.2 s per GB on one thread)."""
        cast_bytes, scratch, compressor = self._thread_state()
        itemsize = DTYPE_SIZES[prev.tag]
        if flat.device.type == "cpu" and flat.dtype == _TAG_TO_TORCH[prev.tag]:
            new = _bytes_of(flat[first : first + count])
        else:
            cast = _typed(cast_bytes, prev.tag)
            cast[:count].copy_(flat[first : first + count])  # the cast (and a GPU's copy to host)
            new = cast_bytes[: count * itemsize]
        lo = first * itemsize
        old = prev.data[lo : lo + count * itemsize]
        frame = delta_codec.encode_frame(new, old, scratch, compressor)
        bad = 0
        if frame is not None:
            if self.check_finite and prev.tag in FLOAT_DTYPES:
                bad = count_non_finite(new, prev.tag, scratch)  # the XOR is compressed: scratch is free
            np.copyto(old, new)  # also when refused: the frame takes it back (_undo_frames)
        if hashing is not None:
            hashing.offer(name, part, old.data)
        return frame, bad

    def _thread_state(self) -> tuple[np.ndarray, np.ndarray, Any]:
        """This encode thread's cast and XOR buffers and its compressor, kept across versions."""
        state: tuple[np.ndarray, np.ndarray, Any] | None = getattr(self._scratch, "state", None)
        if state is None:
            state = self._scratch.state = (
                delta_codec.new_scratch(),
                delta_codec.new_scratch(),
                delta_codec.new_compressor(self.level),
            )
        return state

    def _copy_into(self, tensor: torch.Tensor, target: str | None, entry: _Held, reuse: np.ndarray | None) -> _Part:
        """(On an encode thread.) Hold a tensor of a full version; return (None, its NaN/Inf values
        when ``check_finite``): the write then need not count them again."""
        if reuse is not None:  # cast straight into the last version's buffer: no allocation
            _typed(reuse, entry.tag).copy_(tensor.detach().reshape(-1))
            entry.data = reuse
        else:
            t = _prepare(tensor, target)
            entry.data = _keep(tensor, t, _bytes_of(t), None)
        entry.digest = ""  # computed when a delta needs it: a full publish hashes its files itself
        bad = 0
        if self.check_finite and entry.tag in FLOAT_DTYPES:
            bad = count_non_finite_bytes(entry.data, entry.tag, self._thread_state()[1])
        return None, bad

    # --- writing it ---------------------------------------------------------------------------
    def write(
        self,
        root: Path | str,
        step: int,
        *,
        config: dict[str, Any] | Path | str | None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        base_model: str | None = None,
        run_id: str | None = None,
    ) -> PublishResult:
        """Publish the absorbed version as ``step``: a delta when it can, else in full."""
        root = Path(root).absolute()  # a relative root would double when its manifests are read (resolve_inside)
        absorbed = self._absorbed
        if absorbed is None:
            raise RuntimeError("write() needs a version taken in by absorb() first")
        self._absorbed = None
        base = self._pending_base
        # No run id given: the chain's own (a fresh one per call made every delta another run's).
        run_id = check_run_id(run_id if run_id is not None or base is None else base.run_id)
        full_bytes = self._full_data_bytes()
        kind, why_full = ("delta", "") if absorbed.delta else ("full", absorbed.why_full)
        plan: _DeltaPlan | None = None
        if kind == "delta":
            assert base is not None
            delta_bytes = sum(len(b) for b in absorbed.blobs.values())
            if base.run_id != run_id:
                kind, why_full = "full", f"the run id changed ({base.run_id} -> {run_id}): a new run starts a new chain"
            elif base.max_shard_bytes != max_shard_bytes:
                kind, why_full = (
                    "full",
                    f"max_shard_bytes changed ({base.max_shard_bytes} -> {max_shard_bytes}): the shards differ",
                )
            elif delta_bytes > self.max_ratio * full_bytes:
                kind, why_full = (
                    "full",
                    (
                        f"the delta ({delta_bytes / max(full_bytes, 1):.0%} of the"
                        f" full size) is above checkpoint_delta_max_ratio"
                        f" {self.max_ratio:g}"
                    ),
                )
            elif (gone := _chain_gone(root, base)) is not None:
                kind, why_full = "full", gone
            else:
                if config is None:
                    raise ValueError("a delta checkpoint needs the model's config (config.json)")
                plan = self._plan_delta(
                    step,
                    base,
                    absorbed,
                    config=config,
                    max_shard_bytes=max_shard_bytes,
                    base_model=base_model,
                    run_id=run_id,
                )
                if plan.manifest_bytes + MANIFEST_TIME_SLACK > MAX_MANIFEST_BYTES:
                    changed = f"with {len(absorbed.blobs)} changed"
                    kind, why_full = "full", _manifest_too_large(plan.manifest_bytes, len(self._order), changed)
                    plan = None
        t0 = time.perf_counter()
        try:
            if kind == "full":
                result = publish_checkpoint(
                    root,
                    step,
                    self._held_tensors(),
                    config=config,
                    max_shard_bytes=max_shard_bytes,
                    base_model=base_model,
                    run_id=run_id,
                    check_finite=False,  # absorb counted every held byte that changed (check_finite)
                )
                new_base = _Base(
                    step,
                    result.fingerprint,
                    step,
                    0,
                    result.fingerprint,
                    run_id=run_id,
                    max_shard_bytes=max_shard_bytes,
                )
            else:
                assert base is not None and plan is not None
                result = self._write_delta(root, step, base, absorbed, plan, max_shard_bytes=max_shard_bytes)
                new_base = _Base(
                    step,
                    result.fingerprint,
                    base.chain_start,
                    base.deltas_since_full + 1,
                    base.chain_fingerprint,
                    base.between + ((base.step,) if base.step != base.chain_start else ()),
                    run_id=run_id,
                    max_shard_bytes=max_shard_bytes,
                )
        except BaseException:
            self._base = None  # the held bytes are of a version that was not published
            raise
        self._base = new_base
        seconds = absorbed.seconds + (time.perf_counter() - t0)
        if self.costs is not None:
            # A delta candidate written in full (too big, base gone) is what a delta cost here.
            self.costs.observe("delta" if absorbed.delta or absorbed.too_large else kind, seconds, result.full_bytes)
        self.last = DeltaStats(
            kind=kind,
            why_full=why_full,
            tensors=len(self._order),
            changed_tensors=len(absorbed.blobs) if kind == "delta" else len(self._order),
            changed_bytes=absorbed.changed_bytes if kind == "delta" else full_bytes,
            full_bytes=result.full_bytes,
            written_bytes=result.total_bytes,
            encode_s=absorbed.seconds,
            write_s=time.perf_counter() - t0,
            chain_length=new_base.deltas_since_full,
        )
        if absorbed.auto_full:
            if not self._said_full_is_faster:
                log.info("step %d published in full: %s", step, why_full)
                self._said_full_is_faster = True
        elif kind == "delta":
            if absorbed.probe:
                log.debug("step %d: a delta to measure deltas again (%s)", step, self._cost_summary())
            elif self._said_full_is_faster:
                log.info("step %d published as a delta: deltas measure faster again (%s)", step, self._cost_summary())
                self._said_full_is_faster = False
        elif base is not None:
            log.info("step %d published in full: %s", step, why_full)
        return result

    def _cost_summary(self) -> str:
        costs = {} if self.costs is None else self.costs.s_per_gb
        return ", ".join(f"{k} {v:.2f} s/GB" for k, v in sorted(costs.items()))

    def _held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._order:
            h = self._held[name]
            yield name, _typed(h.data, h.tag).reshape(h.shape)

    def _full_data_bytes(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def _delta_manifest_floor(self, base: _Base, max_shard_bytes: int) -> int:
        """The size of the manifest of a delta on the held version in which no tensor changed: every
        delta of this layout lists at least that (every tensor's entry, every shard's). Measured
        once per layout (names, dtypes, shapes, order) and shard size: a full serialisation
        (~1 s for 60,000 tensors)."""
        layout = (max_shard_bytes, tuple((n, self._held[n].tag, self._held[n].shape) for n in self._order))
        if self._manifest_floor is None or self._manifest_floor[0] != layout:
            nothing = Absorbed(delta=True, blobs={}, frames={}, dtype=None, seconds=0.0)
            plan = self._plan_delta(
                base.step, base, nothing, config=None, max_shard_bytes=max_shard_bytes, base_model=None, run_id=None
            )
            self._manifest_floor = (layout, plan.manifest_bytes)
        return self._manifest_floor[1]

    def _plan_delta(
        self,
        step: int,
        base: _Base,
        absorbed: Absorbed,
        *,
        config: dict[str, Any] | Path | str | None,
        max_shard_bytes: int,
        base_model: str | None,
        run_id: str | None,
    ) -> _DeltaPlan:
        """Lay out the delta of ``absorbed`` on ``base`` before anything is written: its files, the
        full checkpoint's, every tensor's entry, and the size of its manifest (measured with
        stand-ins for the digests not computed yet, which have the same length). ``config`` None
        leaves the config out (only to measure, see :meth:`_delta_manifest_floor`)."""
        shards = _plan_shards(self._order, self._held, max_shard_bytes)
        names = shard_file_names(len(shards))
        plan = _DeltaPlan(shards, names, [], [], {}, {}, {}, {}, {})
        weight_map: dict[str, str] = {}
        for i, (shard, members) in enumerate(zip(names, shards), start=1):
            prefix, data_len = shard_prefix((n, self._held[n].tag, self._held[n].shape) for n in members)
            plan.prefixes.append(prefix)
            plan.target[shard] = FileEntry(size=len(prefix) + data_len, digest=_UNKNOWN_DIGEST, tensors=len(members))
            changed = [n for n in members if n in absorbed.blobs]
            delta_file = f"delta-{i:05d}-of-{len(shards):05d}.safetensors" if changed else None
            plan.delta_files.append(delta_file)
            if delta_file is not None:  # what _write_shard writes: a header, then the blobs as U8 tensors
                head, blob_bytes = shard_prefix((n, "U8", (len(absorbed.blobs[n]),)) for n in changed)
                plan.files[delta_file] = FileEntry(
                    size=len(head) + blob_bytes, digest=_UNKNOWN_DIGEST, tensors=len(changed)
                )
            for n in members:
                h = self._held[n]
                weight_map[n] = shard
                plan.tensors[n] = DeltaTensor(
                    shard=shard,
                    dtype=h.tag,
                    shape=list(h.shape),
                    digest=h.digest or _UNKNOWN_DIGEST,
                    delta_file=delta_file if n in absorbed.blobs else None,
                    frames=absorbed.frames.get(n),
                )
        if len(shards) > 1:
            plan.small[INDEX_NAME] = index_json(weight_map, self._full_data_bytes()).encode()
        if config is not None:
            text = config_text(config)
            plan.small[CONFIG_NAME] = text.encode() if isinstance(text, str) else text
        for name, raw in plan.small.items():
            plan.files[name] = plan.target[name] = file_entry(raw)
        plan.fields = dict(
            base_model=base_model,
            dtype=absorbed.dtype,
            tensor_count=len(self._order),
            run_id=run_id,
            kind="delta",
            delta=DeltaInfo(
                base_step=base.step,
                base_fingerprint=base.fingerprint,
                chain_start=base.chain_start,
                target_files=plan.target,
                tensors=plan.tensors,
                frame_bytes=delta_codec.CHUNK_BYTES,
                changed_tensors=len(absorbed.blobs),
                changed_bytes=absorbed.changed_bytes,
            ),
        )
        plan.manifest_bytes = len(new_manifest(step, plan.files, **plan.fields).to_json().encode())
        return plan

    def _write_delta(
        self, root: Path, step: int, base: _Base, absorbed: Absorbed, plan: _DeltaPlan, *, max_shard_bytes: int
    ) -> PublishResult:
        """Write the delta laid out in ``plan`` (see :meth:`_plan_delta`), filling in its digests."""
        t0 = time.perf_counter()
        hashed = absorbed.shard_digests if absorbed.max_shard_bytes == max_shard_bytes else None
        files, target = plan.files, plan.target
        with atomic_step_dir(root, step) as tmp:
            for i, (shard, members) in enumerate(zip(plan.names, plan.shards)):
                if hashed is not None:
                    digest = hashed[i]
                else:
                    hasher = new_hasher()
                    hasher.update(plan.prefixes[i])
                    for n in members:
                        _hash_held(self._held[n], hasher)
                    digest = format_digest(hasher)
                target[shard].digest = digest
                delta_file = plan.delta_files[i]
                if delta_file is not None:
                    files[delta_file] = _write_shard(
                        tmp / delta_file,
                        [
                            (n, torch.frombuffer(absorbed.blobs[n], dtype=torch.uint8))  # no copy
                            for n in members
                            if n in absorbed.blobs
                        ],
                    )
            for n, entry in plan.tensors.items():
                entry.digest = self._held[n].digest
            for name, raw in plan.small.items():
                write_small(tmp / name, raw)
            manifest = write_manifest(tmp, step, files, **plan.fields)
        total = time.perf_counter() - t0
        full = sum(e.size for e in target.values())
        log.info(
            "published %s as a delta on step %d: %d of %d tensors changed, %.2f MB (%.1f%% of %.1f MB) in %.2f s",
            root / step_dir_name(step),
            base.step,
            len(absorbed.blobs),
            len(self._order),
            manifest.total_bytes / 1e6,
            100 * manifest.total_bytes / max(full, 1),
            full / 1e6,
            total,
        )
        return PublishResult(
            path=root / step_dir_name(step),
            step=step,
            weight_version=manifest.weight_version,
            total_bytes=manifest.total_bytes,
            tensor_count=manifest.tensor_count,
            files=len(files),
            write_seconds=total,
            total_seconds=total,
            kind="delta",
            fingerprint=manifest.fingerprint(),
            full_bytes=full,
        )


def _manifest_too_large(size: int, tensors: int, how: str) -> str:
    """Why a version is published in full: its delta's manifest would be ``size`` bytes."""
    return (
        f"a delta's manifest lists every tensor: this model's {tensors} ({how}) would make it"
        f" {size / 2**20:.1f} MiB, more than the {MAX_MANIFEST_BYTES / 2**20:g} MiB readers read"
    )


def _plan_shards(order: list[str], held: dict[str, _Held], max_shard_bytes: int) -> list[list[str]]:
    """The tensors of each shard a full publish of ``held`` (in ``order``) writes."""
    planner = ShardPlanner(max_shard_bytes)
    shards: list[list[str]] = []
    for name in order:
        if planner.starts_new_shard(held[name].nbytes):
            shards.append([])
        shards[-1].append(name)
    return shards


class _LayoutDigests:
    """The digests a delta's manifest needs (each shard's and each tensor's, of the bytes a full
    publish would write), taken part by part from the held copy as the encode threads update
    it, while those bytes are still in cache: the write then reads nothing back (0.15-0.2 s
    per GB on one thread, ``docs/benchmarks.md`` §4h). The shards are the last version's: a
    delta keeps its layout (names, shapes, dtypes, order); when it does not, the version is
    full and these digests are dropped."""

    def __init__(self, order: list[str], held: dict[str, _Held], max_shard_bytes: int):
        self.shards = _plan_shards(order, held, max_shard_bytes)
        self._slots: dict[str, tuple[OrderedDigests, int]] = {}
        """Per tensor: its shard's digests and the index of its first part there."""
        self._digests: list[OrderedDigests] = []
        for members in self.shards:
            prefix, _ = shard_prefix((n, held[n].tag, held[n].shape) for n in members)
            part_tensors: list[int] = []
            firsts: list[tuple[str, int]] = []
            for i, name in enumerate(members):
                firsts.append((name, len(part_tensors)))
                part_tensors += [i] * -(-held[name].nbytes // delta_codec.CHUNK_BYTES)
            digests = OrderedDigests(prefix, part_tensors, len(members))
            self._digests.append(digests)
            self._slots.update((name, (digests, first)) for name, first in firsts)

    def offer(self, name: str, part: int, data: memoryview) -> None:
        """Part ``part`` of tensor ``name`` is final in the held copy (never waits)."""
        digests, first = self._slots[name]
        digests.offer(first + part, data)

    def finish(self, held: dict[str, _Held]) -> list[str]:
        """Each shard's digest once every part was offered (every encode job returned), and each
        tensor's set on ``held``."""
        results = [digests.result() for digests in self._digests]
        for members, (_, tensor_digests) in zip(self.shards, results):
            for name, digest in zip(members, tensor_digests):
                held[name].digest = digest
        return [file_digest for file_digest, _ in results]


def _tag_after_prepare(tensor: torch.Tensor, target: str | None) -> str:
    """The safetensors dtype ``_prepare`` will give ``tensor`` (without casting it yet)."""
    tag = _TORCH_TO_TAG.get(tensor.dtype)
    if tag is None:
        raise TypeError(f"tensor dtype {tensor.dtype} cannot be stored in safetensors")
    return target if target is not None and tag in FLOAT_DTYPES else tag


_NO_BYTES = np.empty(0, dtype=np.uint8)

_Part = tuple[bytes | None, int]
"""What an encode job returns: a part's frame (None: unchanged) and its NaN/Inf values."""


def _undo_frames(h: _Held, blob: bytes | bytearray, sizes: list[int]) -> None:
    """Put a tensor's held bytes back to the version before: XOR each changed part with its
    frame (``zstd(new XOR old)``) again. Only after a refused version (rare): one thread."""
    scratch = delta_codec.new_scratch()
    at = 0
    for i, size in enumerate(sizes):
        if not size:
            continue
        lo = i * delta_codec.CHUNK_BYTES
        piece = h.data[lo : min(lo + delta_codec.CHUNK_BYTES, h.nbytes)]
        with delta_codec.FrameReader(memoryview(blob)[at : at + size], piece.shape[0], where="undo") as reader:
            reader.xor_into(piece, scratch[: piece.shape[0]])
            reader.finish()
        at += size
    h.digest = ""


def _typed(data: np.ndarray, tag: str) -> torch.Tensor:
    """Flat ``uint8`` bytes as a flat tensor of safetensors dtype ``tag``, sharing their memory
    (an empty array gets an empty tensor: its stride cannot be viewed as another dtype)."""
    dtype = _TAG_TO_TORCH[tag]
    if not data.shape[0]:
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(data).view(dtype)


def _keep(source: torch.Tensor, prepared: torch.Tensor, raw: np.ndarray, old: np.ndarray | None) -> np.ndarray:
    """The bytes to hold for a tensor: ``raw`` itself when ``_prepare`` made a new tensor (a cast
    or a copy off the GPU: nobody else has it, and keeping it saves a copy of the model), else a
    copy (into ``old`` when it fits): the source may be a live parameter or a buffer its
    producer reuses."""
    if source.numel() and prepared.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        return raw
    if old is None or old.shape[0] != raw.shape[0]:
        old = np.empty(raw.shape[0], dtype=np.uint8)
    np.copyto(old, raw)
    return old


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _hash_held(h: _Held, shard_hasher: Any) -> None:
    """Feed a tensor's held bytes to its shard's hasher and, part by part in the same pass
    (the part is still in cache), to its own digest when that is not known yet (it changed,
    or nothing has needed it since a full publish)."""
    own = None if h.digest else new_hasher()
    data = h.data
    for start in range(0, h.nbytes, delta_codec.CHUNK_BYTES):
        part = data[start : start + delta_codec.CHUNK_BYTES].data
        shard_hasher.update(part)
        if own is not None:
            own.update(part)
    if own is not None:
        h.digest = format_digest(own)


def _chain_gone(root: Path, base: _Base) -> str | None:
    """Why a delta on ``base`` could not be rebuilt from what the root holds now; None when it
    could: the base step and its chain's full step are under the root with the manifests this
    writer wrote (not pruned, not replaced, readable), and the deltas between them are there (two
    manifest reads and a look per delta between)."""
    gone = f"the chain of step {base.step} (the delta's base) is no longer published as it was"
    links = [(base.step, base.fingerprint)]
    if base.chain_start != base.step:
        links.append((base.chain_start, base.chain_fingerprint))
    for step, fingerprint in links:
        try:
            found = Manifest.load(root / step_dir_name(step), root=root).fingerprint()
        except CheckpointError as exc:
            if exc.reason in ("unreadable", "too_large"):  # not known to be gone: still no delta on it
                return f"the chain of step {base.step} (the delta's base) cannot be read now: {exc.reason}: {exc}"
            return gone
        if found != fingerprint:
            return gone
    if not all(os.path.isdir(root / step_dir_name(s)) for s in base.between):
        return gone
    return None
