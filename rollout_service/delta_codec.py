"""The per-tensor delta codec: ``zstd(new bytes XOR base bytes)`` and its inverse.

At RL learning rates most bf16 weights do not change from one step to the next (bf16 hides
updates below about |w|/256), so the XOR of two versions' bytes is mostly zeros and zstd
at level 1 shrinks it to a few percent (the field's choice, see ``../shared/docs/FIELD.md``).
Both directions work on flat ``uint8`` numpy views: XOR runs at memory speed and zstandard
releases the GIL, so callers can run several tensors on a thread pool.

Blobs are untrusted on the reading side: :func:`decode` checks the frame's declared size
before it allocates anything.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .checkpoint_format import CheckpointError

ZSTD_LEVEL = 1


def encode(new: np.ndarray, base: np.ndarray, level: int = ZSTD_LEVEL) -> bytes | None:
    """The compressed XOR of two equally long ``uint8`` arrays; None when they are equal."""
    if new.shape != base.shape:
        raise ValueError(f"cannot XOR {new.shape[0]} bytes with {base.shape[0]}")
    diff = np.bitwise_xor(new, base)
    if not diff.any():
        return None
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(diff.data)


def decode(blob: bytes | memoryview, base: np.ndarray, *, where: str) -> np.ndarray:
    """``base`` XOR the decompressed ``blob``: the new bytes. Raises ``CheckpointError``."""
    size = base.shape[0]
    try:
        params = zstandard.get_frame_parameters(blob)
    except zstandard.ZstdError as exc:
        raise CheckpointError("delta_corrupt", f"{where}: not a zstd frame ({exc})") from None
    if params.content_size != size:
        raise CheckpointError(
            "delta_corrupt",
            f"{where}: the delta frame declares {params.content_size} bytes, the tensor has {size}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CheckpointError("delta_corrupt", f"{where}: the delta does not decompress ({exc})") from None
    if len(raw) != size:
        raise CheckpointError("delta_corrupt", f"{where}: the delta decompresses to {len(raw)}"
                              f" bytes, the tensor has {size}")
    return np.bitwise_xor(base, np.frombuffer(raw, dtype=np.uint8))
