"""The delta codec: ``zstd(new bytes XOR base bytes)``, one zstd frame per part of a tensor.

At RL learning rates most bf16 weights do not change from one step to the next (bf16 hides
updates below about |w|/256), so the XOR of two versions' bytes is mostly zeros and zstd
at level 1 shrinks it to a few percent (the field's choice, see ``../shared/docs/FIELD.md``).
Each :data:`~rollout_service.checkpoint_format.DELTA_FRAME_BYTES` part of a tensor is its own
frame (format: ``checkpoint_format.DELTA_CODEC``), so the parts of one big tensor (a 1 GB
embedding) are encoded and applied on several threads, and a part that did not change has no
frame at all. Both directions work on flat ``uint8`` numpy views: XOR runs at memory speed and
zstandard releases the GIL.

Frames are untrusted on the reading side: :class:`FrameReader` checks the size a frame
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
    frame: bytes = compressor.compress(diff.data)
    # zstd writes zeros as a few bytes per 128 KiB block: only a frame about that small can hold
    # an unchanged part, so only such a frame costs a scan of the XOR (a pass over the part:
    # 0.075 s per GB on one thread, which every changed part is spared).
    if len(frame) <= n // 4096 + 128 and not diff.any():
        return None
    return frame


SLICE_BYTES = 1 << 20
"""A rebuild works through a part in slices of this size: a slice's read, decompression, XOR,
check and write all stay in the CPU cache, where a whole 16 MiB part would not."""


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
"""The first four bytes of a zstd frame (RFC 8878; a skippable frame has another)."""


class FrameReader:
    """One frame decompressed slice by slice and XORed into the part it rebuilds.

    Frames are untrusted: the size a frame declares is checked before anything is
    decompressed, and :meth:`finish` checks that it held exactly that many bytes. Raises
    ``CheckpointError('delta_corrupt')`` naming ``where``. Use as a context manager.
    """

    def __init__(self, frame: bytes | memoryview, n: int, *, where: str):
        self.n, self.where, self._got = n, where, 0
        if bytes(frame[:4]) != ZSTD_MAGIC:  # (a skippable frame first would be read past)
            raise CheckpointError("delta_corrupt", f"{where}: not a zstd frame (it does not start with zstd's magic)")
        try:
            declared = zstandard.get_frame_parameters(frame).content_size
        except zstandard.ZstdError as exc:
            raise CheckpointError("delta_corrupt", f"{where}: not a zstd frame ({exc})") from None
        if declared != n:
            raise CheckpointError("delta_corrupt", f"{where}: the frame declares {declared} bytes, the part has {n}")
        self._reader = zstandard.ZstdDecompressor().stream_reader(frame)

    def __enter__(self) -> FrameReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.close()

    def xor_into(self, piece: np.ndarray, scratch: np.ndarray) -> None:
        """XOR the frame's next ``len(piece)`` bytes into ``piece`` (via ``scratch``, as long)."""
        m = piece.shape[0]
        view = scratch.data
        got = 0
        try:
            while got < m:
                k = self._reader.readinto(view[got:m])
                if not k:
                    break
                got += k
        except zstandard.ZstdError as exc:
            raise CheckpointError("delta_corrupt", f"{self.where}: the frame does not decompress ({exc})") from None
        self._got += got
        if got != m:
            raise self._wrong_size()
        np.bitwise_xor(piece, scratch[:m], out=piece)

    def _wrong_size(self) -> CheckpointError:
        return CheckpointError("delta_corrupt", f"{self.where}: the frame holds other than the part's {self.n} bytes")

    def finish(self) -> None:
        """Raise unless the frame held exactly the part's bytes (nothing after them)."""
        try:
            extra = self._reader.read(1)
        except zstandard.ZstdError as exc:
            raise CheckpointError("delta_corrupt", f"{self.where}: the frame does not decompress ({exc})") from None
        if self._got != self.n or extra:
            raise self._wrong_size()
