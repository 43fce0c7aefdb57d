"""Finding NaN/Inf weights in a safetensors file's bytes, at memory speed, without torch.

NaN and Inf are the floating values whose exponent bits are all ones, so each dtype is
checked on its raw bits with numpy (which has no bfloat16): for bf16 that is
``bits & 0x7FFF >= 0x7F80``. FP8 E4M3 has no Inf; its NaN is ``0x7F``/``0xFF``.
"""

from __future__ import annotations

import numpy as np

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
