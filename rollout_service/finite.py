"""Finding NaN/Inf weights in a safetensors file's bytes, at memory speed, without torch.

NaN and Inf are the floating values whose exponent bits are all ones, so each dtype is
checked on its raw bits with numpy (which has no bfloat16): for bf16 that is
``bits & 0x7FFF >= 0x7F80``. FP8 E4M3 has no Inf; its NaN is ``0x7F``/``0xFF``.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from .untrusted_files import NO_DEADLINE, Deadline

# dtype tag -> (unsigned view, all bits but the sign, the smallest non-finite magnitude): a value
# is NaN/Inf when its bits without the sign are at least that (its exponent bits all ones; for
# FP8 E4M3, which has no Inf, its one NaN pattern 0x7F).
_NON_FINITE = {
    "F64": (np.uint64, np.uint64(0x7FFFFFFFFFFFFFFF), np.uint64(0x7FF0000000000000)),
    "F32": (np.uint32, np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)),
    "F16": (np.uint16, np.uint16(0x7FFF), np.uint16(0x7C00)),
    "BF16": (np.uint16, np.uint16(0x7FFF), np.uint16(0x7F80)),
    "F8_E5M2": (np.uint8, np.uint8(0x7F), np.uint8(0x7C)),
    "F8_E4M3": (np.uint8, np.uint8(0x7F), np.uint8(0x7F)),
}
_CHUNK_ELEMENTS = 8 << 20


def first_non_finite(data: memoryview, *, deadline: Deadline = NO_DEADLINE) -> tuple[str, int] | None:
    """``(tensor name, count of NaN/Inf values)`` of the first tensor that has any, else None.

    ``data`` is a whole safetensors file whose header safetensors has already accepted.
    """
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(bytes(data[8 : 8 + header_len]))
    base = 8 + header_len
    for name, info in sorted(header.items(), key=lambda kv: str(kv[0])):
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        dtype = info.get("dtype")
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        count = 0
        step = _CHUNK_ELEMENTS * 8
        for i in range(0, len(raw), step):
            deadline.check(name)
            count += count_non_finite(raw[i : i + step], str(dtype))
        if count:
            return str(name), count
    return None


def count_non_finite(raw: memoryview | bytes | np.ndarray, dtype: str, scratch: np.ndarray | None = None) -> int:
    """NaN/Inf values among ``raw``'s elements of safetensors dtype ``dtype`` (0 for non-floats).

    ``raw`` holds whole elements (a chunk of a tensor cut at a multiple of 8 bytes is fine).
    ``scratch`` (``uint8``, at least as long as ``raw``) takes the one temporary, so that a
    caller checking many chunks allocates (and page-faults) nothing: finite data, the common
    case, costs one masking pass and one max."""
    spec = _NON_FINITE.get(dtype)
    if spec is None:
        return 0
    view_type, magnitude, smallest = spec
    bits = np.frombuffer(raw, dtype=view_type)
    if not bits.size:
        return 0
    out = None if scratch is None else scratch[: bits.nbytes].view(view_type)
    mags = np.bitwise_and(bits, magnitude, out=out)
    if mags.max() < smallest:
        return 0
    return int(np.count_nonzero(mags >= smallest))
