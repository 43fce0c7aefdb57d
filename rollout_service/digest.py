"""Content digests of checkpoint files (xxh3-128: integrity, not security).

xxh3 hashes at memory speed, so the writer can digest bytes as it writes them and
a reader can afford ``--digests``. Figures: ``benchmarks/publish_bench.py`` (xxh3-128 vs sha256).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from .checkpoint_format import DIGEST_ALGORITHM

_CHUNK = 8 << 20


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def format_digest(hasher: xxhash.xxh3_128) -> str:
    return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"


def file_digest(path: Path) -> str:
    """Digest of a whole file, read in 8 MiB chunks."""
    hasher = new_hasher()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            hasher.update(view[:n])
    return format_digest(hasher)
