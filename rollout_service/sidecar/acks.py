"""Acknowledgement files: ``<root>/acks/<replica-id>.json``, replaced atomically.

A trainer can wait for N replicas through shared storage alone by reading these
files (see :func:`read_acks`); ``heartbeat`` tells a live replica from a dead one.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ..checkpoint_format import ACKS_DIR, TEMP_PREFIX


def ack_dir(root: Path) -> Path:
    return Path(root) / ACKS_DIR


def write_ack(root: Path, replica_id: str, payload: dict[str, Any]) -> Path:
    """Atomically replace this replica's ack file with ``payload`` plus a heartbeat time."""
    directory = ack_dir(root)
    directory.mkdir(exist_ok=True)
    path = directory / f"{replica_id}.json"
    tmp = directory / f"{TEMP_PREFIX}{replica_id}-{uuid.uuid4().hex[:8]}"
    data = dict(payload, replica_id=replica_id, heartbeat=time.time())
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_acks(root: Path, *, max_age_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Ack payloads by replica id; with ``max_age_s``, only replicas whose heartbeat is that fresh."""
    acks: dict[str, dict[str, Any]] = {}
    directory = ack_dir(root)
    if not directory.is_dir():
        return acks
    now = time.time()
    for path in directory.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if max_age_s is not None and now - float(data.get("heartbeat", 0)) > max_age_s:
            continue
        acks[path.stem] = data
    return acks
