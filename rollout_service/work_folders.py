"""Naming hidden work folders after the process that writes them, to find those a dead one left.

A publisher's ``.tmp-step-*`` folder in the checkpoint root and ``materialize``'s
``.tmp-materialize-*`` folder end in ``-<owner_tag()>-<12 hex digits>``: the host (with its boot
and PID namespace, so that containers sharing a host name do not mistake each other's processes)
and the PID. :func:`left_by_dead_writer` tells a folder whose writer is gone, which may be removed
however young it is, from one a live process is still filling.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
from pathlib import Path

from .tree_removal import remove_tree

log = logging.getLogger(__name__)

_TAG_RE = re.compile(r"-h([0-9a-f]{8})p([0-9]+)-[0-9a-f]{12}$", re.ASCII)


def owner_tag(pid: int | None = None) -> str:
    """``h<host hash>p<pid>``: which process writes a work folder, so that one left by a writer
    that died on this host is removed at the next start, however young it is (``pid``: another
    process of this host, default this one)."""
    return f"h{_host_hash()}p{os.getpid() if pid is None else pid}"


def _host_hash() -> str:
    """This host, boot and PID namespace: where a PID names one process (containers sharing a
    host name, or a host rebooted, get another hash, and their folders age out instead)."""
    parts = [socket.gethostname()]
    for where in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(where) if where.endswith("/pid") else Path(where).read_text().strip())
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def left_by_dead_writer(name: str) -> bool:
    """A work folder named ``...-<owner_tag()>-<12 hex>`` by a process of this host (same boot,
    same PID namespace) that no longer runs."""
    match = _TAG_RE.search(name)
    if match is None or match.group(1) != _host_hash():
        return False
    pid = int(match.group(2))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def remove_left_by_dead_writers(parent: Path, prefix: str, what: str) -> None:
    """Remove the folders of ``parent`` named ``<prefix>...-<owner_tag()>-<12 hex>`` whose writer
    died on this host (SIGKILL, a power cut): ``what`` names them in the log."""
    with os.scandir(parent) as entries:
        names = [e.name for e in entries if e.name.startswith(prefix)]
    for name in names:
        if left_by_dead_writer(name):
            log.info("removing %s, left by %s that was killed", parent / name, what)
            try:
                remove_tree(parent / name)
            except OSError as exc:
                log.warning("could not remove %s: %s; remove it by hand", parent / name, exc)
