"""Deleting old checkpoints from the shared root without pulling one out from under a replica.

:func:`prune_checkpoints` keeps the newest ``keep`` ``step-*`` directories plus every step in
``protected`` (what live replicas serve or are loading). A deleted step first disappears by an
atomic rename into a hidden ``.tmp-`` name, so a sidecar never sees a half-deleted checkpoint;
the hidden copy is then removed (or, if that fails, left to ``cleanup_stale_temp_dirs``).

A ``delta`` step needs every step of its chain back to its full step (a late joiner replays
them): those are kept as long as a kept step needs them (:func:`chain_dependencies`).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from rollout_service.checkpoint_format import TEMP_PREFIX, CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints

log = logging.getLogger(__name__)


def prune_checkpoints(root: Path | str, keep: int, protected: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Delete all but the newest ``keep`` checkpoints under ``root``, sparing ``protected`` steps.

    Returns the deleted steps, oldest first.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest checkpoint is what replicas load), got {keep}")
    root = Path(root)
    found = list_checkpoints(root)
    kept = {c.step for c in found[-keep:]} | set(protected)
    try:
        needed = kept | chain_dependencies(root, kept)
    except CheckpointError as exc:
        log.warning(
            "not deleting old checkpoints under %s this time: %s (retention deletes nothing it cannot"
            " prove unneeded; it tries again at the next publish)",
            root,
            exc,
        )
        return []
    doomed = [c for c in found[:-keep] if c.step not in needed]
    removed: list[int] = []
    for ckpt in doomed:
        hidden = root / f"{TEMP_PREFIX}deleting-{ckpt.path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(ckpt.path, hidden)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", ckpt.path, exc)
            continue
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(ckpt.step)
    if removed:
        log.info(
            "deleted old checkpoint step(s) %s under %s (keeping %d, protected %s)",
            removed,
            root,
            keep,
            sorted(needed - {c.step for c in found[-keep:]}),
        )
    return removed


def chain_dependencies(root: Path, steps: set[int]) -> set[int]:
    """Every step the delta steps among ``steps`` are built on, back to their full steps.

    A step that is gone, or whose manifest is not a manifest (no one can apply it), protects
    nothing more. A manifest that cannot be read now (EIO, EACCES, a stale NFS handle) might be
    a delta: that raises ``CheckpointError('unreadable')``, so that nothing its chain needs is
    deleted on a guess.
    """
    needed: set[int] = set()
    todo = sorted(steps)
    seen: set[int] = set()
    while todo:
        step = todo.pop()
        if step in seen:
            continue
        seen.add(step)
        try:
            manifest = Manifest.load(root / step_dir_name(step), root=root)
        except CheckpointError as exc:
            if exc.reason in ("unreadable", "validation_timeout"):
                raise
            continue
        except ValueError:
            continue
        if manifest.kind == "delta" and manifest.delta is not None:
            needed.add(manifest.delta.base_step)
            todo.append(manifest.delta.base_step)
    return needed
