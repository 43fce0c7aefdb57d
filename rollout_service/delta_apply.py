"""Rebuilding full checkpoints from delta chains, verified bit for bit.

:func:`reconstruct` applies one ``delta`` step to the full copy of its base and writes the
full checkpoint it stands for: each shard is read from the base (checking the base's own
digests on the way), each changed tensor is XORed with its decompressed delta, and every
tensor and every output file is checked against the digests a full publish would have
written. :func:`resolve_chain` walks a delta back to something already reconstructed (a
staged copy) or to the full step its chain starts from; :func:`materialize` rebuilds any
retained step as a plain HF model directory (``rollout-service materialize``).

Everything read from the checkpoint root is untrusted (opened through
:mod:`~rollout_service.untrusted_files`, bounded, digests checked before use); output
appears only by an atomic rename, so a reader killed mid-way leaves a hidden ``.tmp-*``
folder and never a half-applied copy under a final name.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from . import delta_codec
from .checkpoint_format import (
    MANIFEST_NAME,
    MAX_CHAIN_FRAMES,
    MAX_CHAIN_FREE_TEXT,
    MAX_CHAIN_LENGTH,
    MAX_CHAIN_NAME_CHARS,
    MAX_CHAIN_TENSORS,
    TEMP_PREFIX,
    CheckpointError,
    DeltaInfo,
    DeltaTensor,
    FileEntry,
    Manifest,
    step_dir_name,
)
from .checkpoint_paths import is_inside
from .digest import format_digest, new_hasher
from .finite import count_non_finite
from .full_writes import pwrite_all, write_all
from .ordered_digests import Abandoned, OrderedDigests
from .safetensors_header import count_entries, header_length, parse_entries, read_header
from .tree_removal import remove_tree
from .untrusted_files import Deadline, VerifiedRead, copy_verified, open_regular
from .user_paths import new_folder_path
from .work_folders import owner_tag, remove_left_by_dead_writers

log = logging.getLogger(__name__)

MAX_OUT_NAME_BYTES = 255
"""The longest name ``materialize``'s output folder may have (a file system's limit)."""
MAX_DELTA_HEADER_BYTES = 16 << 20
"""A delta file's header: one short entry per changed tensor of the file (and at most
:func:`_delta_header_bound` of the tensors it holds)."""
DELTA_HEADER_ENTRY_BYTES = 160
"""A delta header's entry beside its name's JSON: dtype, a 1-D shape and two offsets of up to
20 digits each, the punctuation; the metadata entry and padding fit in one more."""
MAX_DELTA_FILES_PER_SHARD = 8
"""Delta files one target shard's tensors may name (the writer uses one per shard): each is
held open, its bytes buffered, until the shard is rebuilt."""
CHAIN_START_SLACK_BYTES = 16 << 20
"""How much more than the model it rebuilds a chain's full step may list (past 1%): a chain keeps
its tensors, so only its config and index can differ. Larger, it is not copied into the stage."""

FindStaged = Callable[[int, str], "tuple[Path, Manifest] | None"]
"""(step, published fingerprint) -> an already reconstructed full copy of it, if any."""


@dataclass
class ChainLink:
    """One published step of a chain: its directory under the root and its manifest."""

    path: Path
    manifest: Manifest


@dataclass
class Chain:
    """What it takes to rebuild a step: a full copy to start from, then deltas in order."""

    start: ChainLink
    start_is_staged: bool
    """``start`` is an already verified local copy (else a published full step to copy in)."""
    deltas: list[ChainLink]


def resolve_chain(
    root: Path, link: ChainLink, find_staged: FindStaged | None = None, deadline: Deadline | None = None
) -> Chain:
    """Walk ``link`` back to a staged copy or to its chain's full step.

    Every step on the way is untrusted as much as ``link``: a base that is gone, unreadable,
    republished (another fingerprint), of another run, of another tensor layout, or in another
    chain (``chain_start``), and a walk longer than ``MAX_CHAIN_LENGTH`` steps or holding more
    than ``MAX_CHAIN_FRAMES`` frame sizes, ``MAX_CHAIN_TENSORS`` tensor entries or
    ``MAX_CHAIN_NAME_CHARS`` characters of their names in its manifests, raise
    ``CheckpointError('broken_chain')``: the step cannot be rebuilt until the next full one.
    The walk checks ``deadline`` at every step and holds only manifests of ``link``'s layout.
    """
    deltas: list[ChainLink] = []
    cur = link
    top = link.manifest.delta
    top_layout = _layout(top) if top is not None else []
    load = ChainLoad()
    while cur.manifest.kind == "delta":
        delta = cur.manifest.delta
        assert delta is not None and top is not None
        if deadline is not None:
            deadline.check(f"the delta chain of {link.path.name}")
        if delta.chain_start != top.chain_start or (cur is not link and _layout(delta) != top_layout):
            raise CheckpointError(
                "broken_chain",
                f"{cur.path.name} is in the delta chain of {link.path.name} but"
                f" {'starts at another full step' if delta.chain_start != top.chain_start else 'has other tensors'}"
                f" ({delta.chain_start} vs {top.chain_start}): the chain cannot be rebuilt; the replica keeps"
                " its weights until the next full step",
            )
        deltas.insert(0, cur)
        load = load.plus(cur.manifest)
        load.check(link.path.name, delta.frame_bytes)
        if find_staged is not None:
            staged = find_staged(delta.base_step, delta.base_fingerprint)
            held = None if staged is None else staged_chain(staged[1])
            if staged is not None and (held is None or held[0] != top.chain_start or not held[1].add(load).within()):
                # A copy rebuilt in another chain (the step says another full step starts it), or
                # whose chain would pass a cap with this step: the walk through the root decides,
                # as it does for a replica without that copy (every replica gives one verdict).
                staged = None
            if staged is not None:
                if staged[1].run_id != cur.manifest.run_id:  # as a base read from the root is checked
                    raise CheckpointError(
                        "broken_chain",
                        f"{cur.path.name} and its base {step_dir_name(delta.base_step)} belong to different runs",
                    )
                return Chain(ChainLink(*staged), True, deltas)
        base_path = root / step_dir_name(delta.base_step)
        try:
            base = Manifest.load(base_path, root=root)
        except CheckpointError as exc:
            raise CheckpointError(
                "broken_chain",
                f"{cur.path.name} is a delta on {base_path.name}, which cannot be read ({exc.reason}):"
                f" it cannot be rebuilt; the replica keeps its weights until the next full step",
            ) from None
        if base.fingerprint() != delta.base_fingerprint or base.step != delta.base_step:
            raise CheckpointError(
                "broken_chain",
                f"{cur.path.name} is a delta on another publication of {base_path.name} (it was"
                " republished); the replica keeps its weights until the next full step",
            )
        if base.run_id != cur.manifest.run_id:
            raise CheckpointError(
                "broken_chain", f"{cur.path.name} and its base {base_path.name} belong to different runs"
            )
        cur = ChainLink(base_path, base)
    if top is not None and cur.manifest.kind != "full":
        raise CheckpointError(
            "broken_chain",
            f"{link.path.name}'s delta chain reaches {cur.path.name}, which is an {cur.manifest.kind} step, not a"
            " full one: the chain cannot be rebuilt; the replica keeps its weights until the next full step",
        )
    if top is not None and cur.manifest.step != top.chain_start:
        raise CheckpointError(
            "broken_chain",
            f"{link.path.name}'s delta chain reaches the full step {cur.manifest.step}, its manifest"
            f" says it starts at {top.chain_start}: the chain cannot be rebuilt",
        )
    if top is not None:
        start_bytes, target_bytes = cur.manifest.total_bytes, sum(e.size for e in top.target_files.values())
        if start_bytes > target_bytes + target_bytes // 100 + CHAIN_START_SLACK_BYTES:
            raise CheckpointError(
                "broken_chain",
                f"{link.path.name}'s chain starts at {cur.path.name}, whose files add up to {start_bytes}"
                f" bytes where the model it rebuilds has {target_bytes}: a chain keeps its tensors, so"
                " the full step lists files it does not need; it is not copied, and the replica keeps"
                " its weights until the next full step",
            )
    return Chain(cur, False, deltas)


@dataclass(frozen=True)
class ChainLoad:
    """What the manifests of a chain's deltas hold in all, each bounded (``MAX_CHAIN_*``): a
    reader holds every link's manifest until the chain is applied. A copy rebuilt from a delta
    records its chain's (:func:`reconstruct`), so that a walk ending at it counts the whole chain
    from its full step, as a walk through the root does."""

    links: int = 0
    frames: int = 0
    tensors: int = 0
    names: int = 0
    """Characters of tensor, shard and delta file names."""
    text: int = 0
    """Characters of free-form JSON (``writer``, ``extra``)."""

    def plus(self, manifest: Manifest) -> ChainLoad:
        """This load with the delta ``manifest``'s added."""
        delta = manifest.delta
        assert delta is not None
        return self.add(
            ChainLoad(
                1,
                sum(len(t.frames or ()) for t in delta.tensors.values()),
                len(delta.tensors),
                sum(len(n) + len(t.shard) + len(t.delta_file or "") for n, t in delta.tensors.items()),
                len(json.dumps([manifest.writer, manifest.extra])),
            )
        )

    def add(self, other: ChainLoad) -> ChainLoad:
        return ChainLoad(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def within(self) -> bool:
        """Whether no cap is passed."""
        caps = (MAX_CHAIN_LENGTH, MAX_CHAIN_FRAMES, MAX_CHAIN_TENSORS, MAX_CHAIN_NAME_CHARS, MAX_CHAIN_FREE_TEXT)
        return all(n <= cap for n, cap in zip(astuple(self), caps, strict=True))

    def check(self, name: str, frame_bytes: int) -> None:
        """Raise ``CheckpointError('broken_chain')`` naming the first cap passed (``name``: the
        step whose chain this is)."""
        keeps = "the replica keeps its weights until the next full step"
        more_often = "publish full steps more often (checkpoint_full_every)"
        so_far = f"{self.links} steps so far"
        if self.links > MAX_CHAIN_LENGTH:
            why = f"the delta chain is longer than {MAX_CHAIN_LENGTH} steps"
        elif self.frames > MAX_CHAIN_FRAMES:
            why = (
                f"the manifests of its delta chain list more than {MAX_CHAIN_FRAMES} frames ({so_far},"
                f" {frame_bytes}-byte frames): {more_often} or larger frames; {keeps}"
            )
        elif self.text > MAX_CHAIN_FREE_TEXT:
            why = (
                f"the manifests of its delta chain hold more than {MAX_CHAIN_FREE_TEXT} characters of writer and"
                f" extra data ({so_far}); {keeps}"
            )
        elif self.names > MAX_CHAIN_NAME_CHARS:
            why = (
                f"the manifests of its delta chain hold more than {MAX_CHAIN_NAME_CHARS} characters of tensor and"
                f" file names ({so_far}): {more_often}; {keeps}"
            )
        elif self.tensors > MAX_CHAIN_TENSORS:
            why = (
                f"the manifests of its delta chain list more than {MAX_CHAIN_TENSORS} tensor entries ({so_far}):"
                f" {more_often}; {keeps}"
            )
        else:
            return
        raise CheckpointError("broken_chain", f"{name}: {why}")

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> ChainLoad | None:
        """The load a rebuilt copy's manifest recorded; None when it is not one (any other shape)."""
        if not isinstance(value, dict) or set(value) != {f.name for f in fields(cls)}:
            return None
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value.values()):
            return None
        return cls(**value)


def staged_chain(copy: Manifest) -> tuple[int, ChainLoad] | None:
    """(the full step its chain starts at, the load of the deltas applied since) of a verified
    full copy: ``(its step, nothing)`` for a copy of a full step; what :func:`reconstruct`
    recorded for one rebuilt from a delta; None when a rebuilt copy does not say (then it starts
    no walk)."""
    source = copy.extra.get("reconstructed_from")
    if not isinstance(source, dict) or source.get("kind") != "delta":
        return copy.step, ChainLoad()
    start, load = source.get("chain_start"), ChainLoad.from_json(source.get("chain_load"))
    if isinstance(start, bool) or not isinstance(start, int) or load is None:
        return None
    return start, load


def _layout(delta: DeltaInfo) -> list[tuple[str, str, str, list[int]]]:
    """The tensors a delta reconstructs, in order: one chain keeps them unchanged."""
    return [(name, t.shard, t.dtype, t.shape) for name, t in delta.tensors.items()]


def reconstruct(
    root: Path,
    delta_link: ChainLink,
    base: ChainLink,
    base_root: Path,
    out_dir: Path,
    deadline: Deadline,
    *,
    check_finite: bool = False,
) -> Manifest:
    """Write into the new folder ``out_dir`` the full checkpoint that ``delta_link`` describes.

    ``base`` is a full copy of the delta's base (under ``base_root``). ``check_finite`` refuses
    NaN/Inf in the tensors the delta changes (``non_finite``; the unchanged ones are the
    base's, checked when the base was staged). Returns the manifest
    written into ``out_dir``: kind ``full``, its files the delta's ``target_files``, and
    ``extra.reconstructed_from`` naming the published delta (see
    :meth:`Manifest.source_fingerprint`).
    """
    manifest = delta_link.manifest
    delta = manifest.delta
    assert delta is not None
    name = delta_link.path.name
    if base.manifest.source_fingerprint() != delta.base_fingerprint:
        raise CheckpointError(
            "broken_chain", f"{name} applies to another version of step {delta.base_step} than the copy it was handed"
        )
    by_shard: dict[str, list[str]] = {}
    for tname, t in delta.tensors.items():
        by_shard.setdefault(t.shard, []).append(tname)
    for fname, target in sorted(delta.target_files.items()):
        deadline.check(f"{name}/{fname}")
        if fname in manifest.files:  # config, index: carried whole by the delta
            entry = manifest.files[fname]
            if (entry.size, entry.digest) != (target.size, target.digest):
                raise CheckpointError("bad_manifest", f"{name}: {fname} differs from its target entry")
            copy_verified(
                root,
                delta_link.path / fname,
                out_dir / fname,
                where=f"{name}/{fname}",
                size=entry.size,
                digest=entry.digest,
                deadline=deadline,
            )
            continue
        members = by_shard.get(fname)
        if not members:
            raise CheckpointError(
                "bad_manifest",
                f"{name}: target file {fname} is neither carried by the delta nor a shard of its tensors",
            )
        base_entry = base.manifest.files.get(fname)
        if base_entry is None:
            raise CheckpointError("delta_layout_mismatch", f"{name}: its base has no shard {fname}")
        _rebuild_shard(
            root,
            delta_link,
            base,
            base_root,
            base_entry,
            fname,
            target,
            members,
            out_dir / fname,
            deadline,
            check_finite,
        )
    rebuilt = Manifest(
        step=manifest.step,
        weight_version=manifest.weight_version,
        created_at=manifest.created_at,
        writer=manifest.writer,
        base_model=manifest.base_model,
        dtype=manifest.dtype,
        total_bytes=sum(e.size for e in delta.target_files.values()),
        tensor_count=manifest.tensor_count,
        files=dict(delta.target_files),
        run_id=manifest.run_id,
        kind="full",
        extra={
            "reconstructed_from": {
                "fingerprint": manifest.fingerprint(),
                "kind": "delta",
                "chain_start": delta.chain_start,
                "chain_load": (staged_chain(base.manifest) or (delta.chain_start, ChainLoad()))[1]
                .plus(manifest)
                .to_json(),
            }
        },
    )
    (out_dir / MANIFEST_NAME).write_text(rebuilt.to_json())
    return rebuilt


APPLY_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Tensors of a shard are rebuilt on this many threads (zstd, numpy and file I/O release the GIL)."""
IN_FLIGHT_PARTS = 4 * APPLY_THREADS
"""Parts of a shard submitted and not yet done at most (the rest start as those end)."""
_buffers = threading.local()


def _rebuild_shard(
    root: Path,
    delta_link: ChainLink,
    base: ChainLink,
    base_root: Path,
    base_entry: FileEntry,
    fname: str,
    target: FileEntry,
    members: list[str],
    out_path: Path,
    deadline: Deadline,
    check_finite: bool,
) -> None:
    """Rebuild one shard: its tensors on :data:`APPLY_THREADS` threads, each read from the base at
    its offset, XORed with its blob and written at the same offset of the new file, and hashed
    in file order as it is written (:mod:`~rollout_service.ordered_digests`); then every
    tensor's and the new file's digests are checked. ``out_path`` may be an old file of the
    stage's spare copy: every byte of it is written over (the tensors tile the file) and it is
    cut to the target's size. The base's own digest is computed only when a check fails, to
    tell a damaged base from a corrupt delta (``base_mismatch`` wins): on the happy path the
    new file's digest already proves the base was right."""
    manifest = delta_link.manifest
    delta = manifest.delta
    assert delta is not None
    where = f"{delta_link.path.name}: {fname}"
    base_where = f"{base.path.name}/{fname}"
    with (
        open_regular(base_root, base.path / fname, where=base_where) as (fd, st),
        io.FileIO(os.open(out_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644), "r+") as out,
        contextlib.ExitStack() as open_files,
    ):
        if st.st_size != base_entry.size:
            raise CheckpointError(
                "base_mismatch", f"{base_where} has {st.st_size} bytes, its manifest says {base_entry.size}"
            )
        known = frozenset(members)

        def other_tensors() -> CheckpointError:
            return CheckpointError(
                "delta_layout_mismatch", f"{where}: the base shard holds other tensors than the delta says"
            )

        def same_names(raw: memoryview) -> None:  # counted before it is parsed: a junk base's
            # header (up to 100 MB of tiny entries) would cost ~1 GB as Python objects
            found = count_entries(raw, base_where, limit=len(members), known=known)
            if found.unknown or found.count != len(members):
                raise other_tensors()

        header = read_header(fd, st.st_size, base_where, check=same_names)
        prefix = header.prefix
        order = {e.name: (e.dtype, list(e.shape), e.nbytes) for e in header.entries}
        if sorted(order) != sorted(members):
            raise other_tensors()
        delta_files: dict[str, _DeltaFile] = {}
        tensors: list[tuple[str, DeltaTensor]] = []
        parts: list[tuple[int, int, memoryview | None, str, str]] = []
        part_needs: list[tuple[_DeltaFile, int] | None] = []
        """Per part: the delta file and how far into it must be read before the part can start."""
        part_tensors: list[int] = []
        offset = len(prefix)
        for tname, (dtype, shape, length) in order.items():
            t = delta.tensors[tname]
            if (t.dtype, list(t.shape)) != (dtype, list(shape)):
                raise CheckpointError(
                    "delta_layout_mismatch",
                    f"{where}: tensor {tname} is {dtype} {list(shape)} in the base, {t.dtype} {t.shape} in the delta",
                )
            blob_where = f"{delta_link.path.name}/{t.delta_file or fname}: {tname}"
            frames, source, read_to = None, None, 0
            if t.delta_file is not None:
                source = delta_files.get(t.delta_file)
                if source is None:
                    if len(delta_files) == MAX_DELTA_FILES_PER_SHARD:
                        raise CheckpointError(
                            "delta_corrupt",
                            f"{where}: its tensors name more than {MAX_DELTA_FILES_PER_SHARD} delta files"
                            " (a writer uses one per shard)",
                        )
                    source = delta_files[t.delta_file] = open_files.enter_context(
                        _DeltaFile(root, delta_link, t.delta_file, deadline)
                    )
                blob, read_to = source.blob(tname, where)
                frames = _split_frames(blob, t, blob_where)
            # A changed tensor's parts are its frames; an unchanged one is copied in parts of the
            # writer's size at least (small declared frames must not make one job per 4 KiB).
            step = delta.frame_bytes if frames is not None else max(delta.frame_bytes, delta_codec.CHUNK_BYTES)
            for i, start in enumerate(range(0, length, step)):
                frame = None if frames is None else frames[i]
                parts.append((offset + start, min(step, length - start), frame, t.dtype, f"{blob_where} (part {i})"))
                if frame is None:
                    part_needs.append(None)
                else:
                    assert source is not None
                    read_to += len(frame)  # frames follow each other in the blob
                    part_needs.append((source, read_to))
                part_tensors.append(len(tensors))
            tensors.append((tname, t))
            offset += length
        if offset != target.size:
            raise CheckpointError(
                "delta_layout_mismatch",
                f"{where}: the base's layout makes a {offset}-byte shard, the delta's target has {target.size}",
            )
        write_all(out.fileno(), prefix)
        os.ftruncate(out.fileno(), target.size)
        digests = OrderedDigests(prefix, part_tensors, len(tensors))
        rebuilt: list[Future[None]] = []
        failed = threading.Event()
        """Set by the first part that raises (a done callback: the window checks it in O(1))."""

        def note_failure(job: Future[None]) -> None:
            if not job.cancelled() and job.exception() is not None:
                failed.set()

        with ThreadPoolExecutor(APPLY_THREADS, thread_name_prefix="delta-apply") as pool:
            try:
                # In file order: each part waits for the earlier ones to be hashed. A part starts as
                # soon as its frame is read: the delta file streams in while the threads rebuild.
                for index, ((off, n, frame, dtype, part_where), needs) in enumerate(zip(parts, part_needs)):
                    if index >= IN_FLIGHT_PARTS:  # a bounded window: and once a part failed, no more start
                        wait([rebuilt[index - IN_FLIGHT_PARTS]])
                        if failed.is_set():
                            break
                    if needs is not None:
                        needs[0].read_upto(needs[1])
                    rebuilt.append(
                        pool.submit(
                            _rebuild_part,
                            fd,
                            out.fileno(),
                            off,
                            n,
                            frame,
                            dtype,
                            part_where,
                            base_where,
                            check_finite,
                            deadline,
                            digests,
                            index,
                        )
                    )
                    rebuilt[-1].add_done_callback(note_failure)
                for source in delta_files.values():
                    source.finish()  # the delta files' own size and digest, before any result counts
                wait(rebuilt)
            except BaseException:
                # A bad delta file, or Ctrl-C/SIGTERM in a one-shot command: the parts not yet
                # started never start, and those waiting for their turn to be hashed stop, so
                # leaving the pool waits for a part or two per thread, not the rest of the shard.
                for job in rebuilt:
                    job.cancel()
                digests.abandon()
                raise

        def check_base() -> None:
            if _digest_of_fd(fd, st.st_size, base_where, deadline) != base_entry.digest:
                raise CheckpointError(
                    "base_mismatch", f"{base_where} is not the file its manifest describes (the local copy was damaged)"
                )

        failures = [exc for exc in (job.exception() for job in rebuilt) if exc is not None]
        if failures:
            check_base()
            # The first part that failed by itself (the others stopped because of it).
            raise next((exc for exc in failures if not isinstance(exc, Abandoned)), failures[0])
        file_digest, tensor_digests = digests.result()
        for (tname, t), found in zip(tensors, tensor_digests):
            if found != t.digest:
                check_base()
                raise CheckpointError(
                    "digest_mismatch",
                    f"{where}: tensor {tname} rebuilt to other bytes than were published (the delta is corrupt)",
                )
        if file_digest != target.digest:
            check_base()
            raise CheckpointError(
                "digest_mismatch", f"{where}: the rebuilt shard differs from the published full checkpoint's"
            )


def _split_frames(blob: memoryview, t: DeltaTensor, where: str) -> list[memoryview | None]:
    """A changed tensor's blob cut into its frames (None for a part that did not change)."""
    sizes = t.frames or []
    if sum(sizes) != len(blob):
        raise CheckpointError(
            "delta_corrupt", f"{where}: the blob has {len(blob)} bytes, its frames add up to {sum(sizes)}"
        )
    frames: list[memoryview | None] = []
    at = 0
    for size in sizes:
        frames.append(blob[at : at + size] if size else None)
        at += size
    return frames


def _thread_buffers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's part buffer (at least ``size`` bytes: one frame's part) and its slice
    scratch; reused across parts and syncs: no page faults per part."""
    bufs: tuple[np.ndarray, np.ndarray] | None = getattr(_buffers, "pair", None)
    if bufs is None or bufs[0].shape[0] < size:
        size = max(size, delta_codec.CHUNK_BYTES)
        bufs = _buffers.pair = (delta_codec.new_scratch(size), delta_codec.new_scratch(delta_codec.SLICE_BYTES))
    return bufs


def _rebuild_part(
    base_fd: int,
    out_fd: int,
    offset: int,
    length: int,
    frame: memoryview | None,
    dtype: str,
    where: str,
    base_where: str,
    check_finite: bool,
    deadline: Deadline,
    digests: OrderedDigests,
    index: int,
) -> None:
    """(On an apply thread.) Write one part of a tensor (at most one frame's bytes) at ``offset``
    of the new file: the base's bytes, XORed with the frame's when the part changed, slice by
    slice (:data:`~rollout_service.delta_codec.SLICE_BYTES`: read, XOR, check and write in
    cache); then hash the part's bytes as part ``index`` of ``digests``. Raises
    ``CheckpointError`` for a frame that does not decompress to the part, or that makes NaN/Inf
    with ``check_finite``."""
    try:
        deadline.check(where)
        buf, scratch = _thread_buffers(length)
        with (
            contextlib.nullcontext() if frame is None else delta_codec.FrameReader(frame, length, where=where)
        ) as reader:
            for start in range(0, length, delta_codec.SLICE_BYTES):
                piece = buf[start : min(start + delta_codec.SLICE_BYTES, length)]
                _pread_into(base_fd, piece.data, offset + start, base_where)
                if reader is not None:
                    reader.xor_into(piece, scratch[: piece.shape[0]])
                    if check_finite and count_non_finite(piece, dtype, scratch):
                        raise CheckpointError(
                            "non_finite",
                            f"{where} holds NaN/Inf values; SGLang would load it and generate garbage."
                            " Check the training run for divergence",
                        )
                pwrite_all(out_fd, piece.data, offset + start)
            if reader is not None:
                reader.finish()
        digests.feed(index, buf.data[:length], deadline, where)
    except BaseException:
        digests.abandon()
        raise


def _digest_of_fd(fd: int, size: int, where: str, deadline: Deadline) -> str:
    """The digest of a file's first ``size`` bytes, read with ``pread`` (no shared file position)."""
    hasher = new_hasher()
    buf = bytearray(delta_codec.CHUNK_BYTES)
    view = memoryview(buf)
    done = 0
    while done < size:
        deadline.check(where)
        n = min(size - done, len(buf))
        _pread_into(fd, view[:n], done, where)
        hasher.update(view[:n])
        done += n
    return format_digest(hasher)


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise CheckpointError("truncated", f"{where} ends early")
        got += n


class _DeltaFile:
    """A ``delta-*.safetensors`` file read front to back while its blobs are applied
    (:class:`~rollout_service.untrusted_files.VerifiedRead`: nothing counts until
    :meth:`finish` checked its size and digest). Its header is read and checked at once."""

    def __init__(self, root: Path, link: ChainLink, fname: str, deadline: Deadline):
        entry = link.manifest.files.get(fname)
        if entry is None:
            raise CheckpointError("bad_manifest", f"{link.path.name}: {fname} is not in its files")
        self.where = f"{link.path.name}/{fname}"
        assert link.manifest.delta is not None
        held = [(name, t) for name, t in link.manifest.delta.tensors.items() if t.delta_file == fname]
        blobs = sum(sum(t.frames or ()) for _, t in held)
        self._header_bound = _delta_header_bound(name for name, _ in held)
        if entry.size > 8 + self._header_bound + blobs:
            raise CheckpointError(
                "delta_corrupt",
                f"{self.where} is {entry.size} bytes by its manifest entry, more than a header and the"
                f" {blobs} bytes of frames its tensors name",
            )
        self._read = VerifiedRead(
            root, link.path / fname, where=self.where, size=entry.size, digest=entry.digest, deadline=deadline
        )
        self._blobs: dict[str, tuple[int, int]] = {}
        try:
            self._parse_header(entry.size)
        except BaseException:
            self._read.close()
            raise

    def __enter__(self) -> _DeltaFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._read.close()

    def _parse_header(self, size: int) -> None:
        self._read.upto(min(8, size))
        length = header_length(
            self._read.data[:8], size, self.where, max_bytes=self._header_bound, reason="delta_corrupt"
        )
        self._read.upto(8 + length)
        for e in parse_entries(self._read.data[8 : 8 + length], size, self.where, reason="delta_corrupt"):
            if e.dtype != "U8":
                raise CheckpointError("delta_corrupt", f"{self.where}: {e.name[:80]!r} is {e.dtype}, not U8 bytes")
            self._blobs[e.name] = (e.start, e.end)

    def blob(self, tname: str, where: str) -> tuple[memoryview, int]:
        """The blob of ``tname`` and where it starts in the file: its bytes are valid once
        :meth:`read_upto` passed its end."""
        span = self._blobs.get(tname)
        if span is None:
            raise CheckpointError("delta_corrupt", f"{where}: {self.where} lacks tensor {tname}")
        return self._read.data[span[0] : span[1]], span[0]

    def read_upto(self, end: int) -> None:
        self._read.upto(end)

    def finish(self) -> None:
        self._read.finish()


def _delta_header_bound(names: Iterable[str]) -> int:
    """The largest header a delta file holding blobs of ``names`` may have: an entry of
    :data:`DELTA_HEADER_ENTRY_BYTES` beside each name's JSON (escapes counted), one more for
    the metadata and padding; never past :data:`MAX_DELTA_HEADER_BYTES`."""
    bound = DELTA_HEADER_ENTRY_BYTES
    for name in names:
        bound += len(json.dumps(name)) + DELTA_HEADER_ENTRY_BYTES
        if bound >= MAX_DELTA_HEADER_BYTES:
            return MAX_DELTA_HEADER_BYTES
    return bound


def materialize(
    root: Path | str,
    step: int,
    out: Path | str,
    *,
    timeout_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    check_finite: bool = False,
) -> Manifest:
    """Rebuild step ``step`` under ``root`` as a plain HF model directory ``out``: a new
    directory outside the root (inside it, a step-named ``out`` would be read as a publication).

    The step's manifest must be of that step; every step of its chain is checked as it is walked
    and every byte written against the digests a full publish would have written. Before it gets
    its name, the model is validated by the rules ``rollout-service validate`` applies to a full
    step (headers, sizes, index, config), compared with its own tensors (any dtype it was published
    in: no model is at hand to compare with): a shard whose digest matches a manifest that lies is
    no model, and is refused with validate's reason. An adapter step is no model to rebuild
    (``adapter_step``).

    The work happens in a hidden sibling of ``out`` named after its process
    (:mod:`~rollout_service.work_folders`); one left by a run that was killed (SIGKILL, a power
    cut) is removed by the next run into the same folder.
    A folder without room for the model (two copies while a delta is applied) is refused first.
    Folders this run made for ``out`` are removed again when it fails."""
    # Absolute: resolve_inside reads a relative path as relative to its root (it would double).
    root, out = Path(root).absolute(), materialize_target(out)
    if len(os.fsencode(out.name)) > MAX_OUT_NAME_BYTES:
        raise ValueError(f"{out.name[:40]}...: a directory name of at most {MAX_OUT_NAME_BYTES} bytes, please")
    if os.path.lexists(out):
        raise FileExistsError(f"{out} exists; name a new directory for the materialized checkpoint")
    if is_inside(out, root):
        raise ValueError(f"{out} is inside the checkpoint root {root}; write the model directory outside it")
    deadline = Deadline(timeout_s, what="materializing", flag="materialize's --timeout")
    path = root / step_dir_name(step)
    manifest = Manifest.load(path, root=root)
    if manifest.step != step:
        raise CheckpointError("bad_manifest", f"{path.name}/manifest.json says step {manifest.step}, not {step}")
    if manifest.kind == "adapter":
        raise CheckpointError(
            "adapter_step",
            f"{path.name} is a LoRA adapter step, not a model: there is nothing to rebuild. Its folder"
            f" already is a PEFT adapter directory for the base model (adapter_config.json,"
            f" adapter_model.safetensors): check it with `rollout-service validate {path} --reference"
            " BASE_MODEL_DIR` and load it with PEFT on that base model, or materialize a full step",
        )
    chain = resolve_chain(root, ChainLink(path, manifest), None, deadline)
    made = _make_parents(out.parent)
    try:
        return _materialize_into(root, out, step, manifest, chain, deadline, timeout_s, progress, check_finite)
    except BaseException:
        for folder in made:  # the folders this run made for --out, deepest first, if still empty
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def materialize_target(out: Path | str) -> Path:
    """Where :func:`materialize` puts ``out``: its folder with links and ``..`` resolved as the
    kernel would (``../models/x`` is fine), then its own name, which must be a name (not ``..``)."""
    path = new_folder_path(out, "--out")
    return Path(os.path.realpath(path.absolute().parent)) / path.name


def _make_parents(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents one level at a time; the ones this call made,
    deepest first (one another process made meanwhile is not counted: it is not ours to remove)."""
    missing = []
    at = folder
    while not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    made = []
    for level in reversed(missing):
        try:
            os.mkdir(level)
        except FileExistsError:
            continue
        made.append(level)
    return made[::-1]


def _materialize_into(
    root: Path,
    out: Path,
    step: int,
    manifest: Manifest,
    chain: Chain,
    deadline: Deadline,
    timeout_s: float | None,
    progress: Callable[[str], None] | None,
    check_finite: bool,
) -> Manifest:
    """:func:`materialize`'s work once the chain is known and ``out``'s folder exists."""
    from .checkpoint_reader import read_model_specs, validate_checkpoint  # safetensors: when materializing only

    remove_left_by_dead_writers(out.parent, _work_prefix(out), "a materialize")
    _check_room(out, manifest, copies=2 if chain.deltas else 1)
    work = out.parent / f"{_work_prefix(out)}{owner_tag()}-{uuid.uuid4().hex[:12]}"
    try:
        work.mkdir()  # inside the try: an interrupt right after it still removes the folder
        # Each copy is named as its published step: the checks name its files as validate would.
        current = work / step_dir_name(chain.start.manifest.step)
        current.mkdir()
        if progress:
            progress(f"copying full step {chain.start.manifest.step}")
        base_manifest = copy_in(root, chain.start, current, deadline)
        for i, d in enumerate(chain.deltas, start=1):
            if progress:
                progress(f"applying delta step {d.manifest.step} ({i}/{len(chain.deltas)})")
            nxt = work / step_dir_name(d.manifest.step)
            nxt.mkdir()
            base_manifest = reconstruct(
                root, d, ChainLink(current, base_manifest), work, nxt, deadline, check_finite=check_finite
            )
            remove_tree(current)
            current = nxt
        if progress:
            progress(f"validating step {step}")
        # As `rollout-service validate` checks a full step (no reference: every tensor of a dtype
        # SGLang loads), on this private copy: the root's files could be swapped after a check.
        try:  # compared with its own tensors: no model at hand, and any dtype it was published in is its own
            own = read_model_specs(current)
        except (FileNotFoundError, CheckpointError):
            own = None  # the validation says what is wrong
        validate_checkpoint(
            current,
            root=work,
            reference=own,
            check_finite=check_finite,  # the deltas checked what they changed; this reads it all
            timeout_s=None if timeout_s is None else max(0.001, timeout_s - (time.monotonic() - deadline.started)),
            timeout_flag=deadline.flag,
        )
        try:
            os.rename(current, out)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(
                    f"{out} was made by another run meanwhile; this run's copy is discarded"
                ) from None
            raise
    finally:
        with contextlib.suppress(OSError):  # nothing to remove, or a leftover the next run removes
            remove_tree(work)
    return base_manifest


def _work_prefix(out: Path) -> str:
    """The hidden work folder's name before its owner tag: ``out``'s name cut short so that the
    whole name fits a file system's 255 bytes."""
    return f"{TEMP_PREFIX}materialize-{os.fsencode(out.name)[:64].decode(errors='ignore')}-"


def _check_room(out: Path, manifest: Manifest, copies: int) -> None:
    """ValueError unless ``out``'s file system has room for ``copies`` copies of the model."""
    size = sum(f.size for f in (manifest.delta.target_files if manifest.delta else manifest.files).values())
    st = os.statvfs(out.parent)
    free = st.f_bavail * st.f_frsize
    if free < copies * size:
        raise ValueError(
            f"--out {out}: its file system has {free / 1e6:.1f} MB free, and rebuilding step {manifest.step}"
            f" needs {copies * size / 1e6:.1f} MB ({copies} cop{'ies' if copies > 1 else 'y'} of a"
            f" {size / 1e6:.1f} MB model); free some space or write elsewhere"
        )


def copy_in(root: Path, link: ChainLink, out_dir: Path, deadline: Deadline) -> Manifest:
    """Copy a published full step's files into ``out_dir``, checking every byte against its digest.

    Only the bytes: what they hold (headers, dtypes, config) is for ``validate_checkpoint`` on
    the copy (as :func:`materialize` does)."""
    if link.manifest.kind != "full":
        raise CheckpointError(
            "broken_chain",
            f"{link.path.name} is {'an' if link.manifest.kind == 'adapter' else 'a'} {link.manifest.kind} step,"
            " not a full one: a delta chain must start at a full step",
        )
    for fname, entry in sorted(link.manifest.files.items()):
        copy_verified(
            root,
            link.path / fname,
            out_dir / fname,
            where=f"{link.path.name}/{fname}",
            size=entry.size,
            digest=entry.digest,
            deadline=deadline,
        )
    copy = link.manifest.as_copy()
    (out_dir / MANIFEST_NAME).write_text(copy.to_json())
    return copy
