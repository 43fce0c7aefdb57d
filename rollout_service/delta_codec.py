"""The delta codec: ``zstd(new bytes XOR base bytes)``, one zstd frame per part of a tensor.

At RL learning rates most bf16 weights do not change from one step to the next (bf16 hides
updates below about |w|/256), so the XOR of two versions' bytes is mostly zeros and zstd
at level 1 shrinks it to a few percent (the field's choice, see ``../shared/docs/FIELD.md``).
Each :data:`~rollout_service.checkpoint_format.DELTA_FRAME_BYTES` part of a tensor is its own
frame (format: ``checkpoint_format.DELTA_CODEC``), so the parts of one big tensor (a 1 GB
embedding) are encoded and applied on several threads, and a part that did not change has no
frame at all. Both directions work on flat ``uint8`` numpy views: XOR runs at memory speed and
zstandard releases the GIL.

Frames are untrusted on the reading side: :func:`apply_frame` checks the size a frame
declares before it decompresses anything, and that it holds exactly that many bytes.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .checkpoint_format import DELTA_FRAME_BYTES, CheckpointError

ZSTD_LEVEL = 1
CHUNK_BYTES = DELTA_FRAME_BYTES
"""Encode and rebuild work in parts of this size: one frame each, one reused buffer per thread."""


def new_scratch(size: int = CHUNK_BYTES) -> np.ndarray:
    return np.empty(size, dtype=np.uint8)


def new_compressor(level: int = ZSTD_LEVEL) -> zstandard.ZstdCompressor:
    """A compressor for :func:`encode_frame` (one per thread: they are not thread-safe)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True)


def encode_frame(
    new: np.ndarray, base: np.ndarray, scratch: np.ndarray, compressor: zstandard.ZstdCompressor
) -> bytes | None:
    """One frame: the compressed XOR of two equally long ``uint8`` arrays (at most
    ``len(scratch)`` bytes), declaring its size; None when they are equal."""
    n = new.shape[0]
    if n != base.shape[0] or n > scratch.shape[0]:
        raise ValueError(f"cannot XOR {n} bytes with {base.shape[0]} in a {scratch.shape[0]}-byte buffer")
    diff = np.bitwise_xor(new, base, out=scratch[:n])
    if not diff.any():
        return None
    return compressor.compress(diff.data)


def apply_frame(frame: bytes | memoryview, chunk: np.ndarray, scratch: np.ndarray, *, where: str) -> None:
    """XOR the decompressed ``frame`` into ``chunk`` in place (``chunk`` becomes the new bytes).
    Raises ``CheckpointError('delta_corrupt')`` for a frame that is not the XOR of exactly
    ``len(chunk)`` bytes."""
    n = chunk.shape[0]
    if n > scratch.shape[0]:
        raise ValueError(f"parts are at most {scratch.shape[0]} bytes, got {n}")
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise CheckpointError("delta_corrupt", f"{where}: not a zstd frame ({exc})") from None
    if declared != n:
        raise CheckpointError("delta_corrupt", f"{where}: the frame declares {declared} bytes, the part has {n}")
    view = scratch.data
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            while got < n:
                k = reader.readinto(view[got:n])
                if not k:
                    break
                got += k
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CheckpointError("delta_corrupt", f"{where}: the frame does not decompress ({exc})") from None
    if got != n or extra:
        raise CheckpointError("delta_corrupt", f"{where}: the frame holds other than the part's {n} bytes")
    np.bitwise_xor(chunk, scratch[:n], out=chunk)
