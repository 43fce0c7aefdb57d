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


CHUNK_BYTES = 16 << 20
"""XOR and (de)compression stream through buffers of this size: memory stays bounded (a 7B
model's embedding is 1 GB) and one buffer per thread is reused (no page faults per tensor)."""


def new_scratch() -> np.ndarray:
    return np.empty(CHUNK_BYTES, dtype=np.uint8)


class XorEncoder:
    """Encodes one tensor of ``size`` bytes chunk by chunk (each at most :data:`CHUNK_BYTES`):
    :meth:`add` takes the next new and base bytes, :meth:`finish` returns the blob (one zstd
    frame that declares its size), or None when nothing changed."""

    def __init__(self, size: int, level: int = ZSTD_LEVEL, scratch: np.ndarray | None = None):
        self.size = size
        self._scratch = new_scratch() if scratch is None else scratch
        self._compressor = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=size)
        self._parts: list[bytes] = []
        self._seen = 0
        self._changed = False

    def add(self, new: np.ndarray, base: np.ndarray) -> None:
        n = new.shape[0]
        if n != base.shape[0] or n > CHUNK_BYTES or self._seen + n > self.size:
            raise ValueError(f"cannot XOR {n} bytes with {base.shape[0]} at {self._seen} of {self.size}")
        diff = np.bitwise_xor(new, base, out=self._scratch[:n])
        self._changed = self._changed or bool(diff.any())
        self._parts.append(self._compressor.compress(diff.data))
        self._seen += n

    def finish(self) -> bytes | None:
        if self._seen != self.size:
            raise ValueError(f"encoded {self._seen} of {self.size} bytes")
        self._parts.append(self._compressor.flush())
        return b"".join(self._parts) if self._changed else None


def encode(
    new: np.ndarray, base: np.ndarray, level: int = ZSTD_LEVEL, scratch: np.ndarray | None = None
) -> bytes | None:
    """The compressed XOR of two equally long ``uint8`` arrays (one zstd frame that declares its
    size); None when they are equal. ``scratch`` is a :func:`new_scratch` buffer to reuse."""
    size = new.shape[0]
    if size != base.shape[0]:
        raise ValueError(f"cannot XOR {size} bytes with {base.shape[0]}")
    encoder = XorEncoder(size, level, scratch)
    for start in range(0, size, CHUNK_BYTES):
        end = min(size, start + CHUNK_BYTES)
        encoder.add(new[start:end], base[start:end])
    return encoder.finish()


class XorStream:
    """Applies one tensor's blob chunk by chunk: :meth:`apply` XORs the next ``len(chunk)``
    decompressed bytes into ``chunk`` in place; :meth:`finish` checks that the blob held
    exactly the tensor's bytes. Memory stays at one :data:`CHUNK_BYTES` buffer."""

    def __init__(self, blob: bytes | memoryview, size: int, *, where: str, scratch: np.ndarray | None = None):
        _check_frame(blob, size, where)
        self.where = where
        self.size = size
        self.done = 0
        self._scratch = new_scratch() if scratch is None else scratch
        self._reader = zstandard.ZstdDecompressor().stream_reader(blob)

    def apply(self, chunk: np.ndarray) -> None:
        n = chunk.shape[0]
        if n > self._scratch.shape[0]:
            raise ValueError(f"chunks are at most {self._scratch.shape[0]} bytes, got {n}")
        view = self._scratch.data
        got = 0
        try:
            while got < n:
                k = self._reader.readinto(view[got:n])
                if not k:
                    break
                got += k
        except zstandard.ZstdError as exc:
            raise CheckpointError("delta_corrupt", f"{self.where}: the delta does not decompress ({exc})") from None
        if got != n:
            raise CheckpointError(
                "delta_corrupt", f"{self.where}: the delta holds {self.done + got} bytes, the tensor has {self.size}"
            )
        np.bitwise_xor(chunk, self._scratch[:n], out=chunk)
        self.done += n

    def finish(self) -> None:
        try:
            extra = self._reader.read(1)
        except zstandard.ZstdError as exc:
            raise CheckpointError("delta_corrupt", f"{self.where}: the delta does not decompress ({exc})") from None
        finally:
            self._reader.close()
        if extra or self.done != self.size:
            raise CheckpointError(
                "delta_corrupt", f"{self.where}: the delta holds more bytes than the tensor's {self.size}"
            )


def decode_into(blob: bytes | memoryview, base: np.ndarray, *, where: str) -> None:
    """XOR the decompressed ``blob`` into ``base`` in place: ``base`` becomes the new bytes.
    Raises ``CheckpointError`` for a blob that is not the XOR of exactly ``len(base)`` bytes."""
    stream = XorStream(blob, base.shape[0], where=where)
    for start in range(0, base.shape[0], CHUNK_BYTES):
        stream.apply(base[start : start + CHUNK_BYTES])
    stream.finish()


def _check_frame(blob: bytes | memoryview, size: int, where: str) -> None:
    try:
        params = zstandard.get_frame_parameters(blob)
    except zstandard.ZstdError as exc:
        raise CheckpointError("delta_corrupt", f"{where}: not a zstd frame ({exc})") from None
    if params.content_size != size:
        raise CheckpointError(
            "delta_corrupt", f"{where}: the delta frame declares {params.content_size} bytes, the tensor has {size}"
        )
