"""Deleting old checkpoints from the shared root without pulling one out from under a replica.

:func:`prune_checkpoints` keeps the newest ``keep`` ``step-*`` directories plus every step in
``protected`` (what live replicas serve or are loading). A deleted step first disappears by an
atomic rename into a hidden ``.tmp-`` name, so a sidecar never sees a half-deleted checkpoint;
the hidden copy is then removed (or, if that fails, left to ``cleanup_stale_temp_dirs``).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from rollout_service.checkpoint_format import TEMP_PREFIX
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
    doomed = [c for c in found[:-keep] if c.step not in protected]
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
        log.info("deleted old checkpoint step(s) %s under %s (keeping %d, protected %s)", removed, root, keep,
                 sorted(protected))
    return removed
