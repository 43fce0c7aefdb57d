"""Build a cached directory once, atomically, even with several builders at the same time."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .tree_removal import remove_tree

logger = logging.getLogger(__name__)


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Return ``final``, first building it with ``build(staging_dir)`` if it does not exist.

    ``build`` fills a hidden staging sibling that is renamed into place; a concurrent builder
    that wins the rename is used as is, and a failed build leaves nothing behind.
    """
    final = Path(final)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    try:
        build(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("another process built %s first; using its copy", final)
    finally:
        if staging.exists():
            with contextlib.suppress(OSError):
                remove_tree(staging)
    return final
