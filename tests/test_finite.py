"""NaN/Inf counting on raw bits (``rollout_service.finite``), against torch's own ``isfinite``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_service.finite import count_non_finite

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
}


@pytest.mark.parametrize("tag", sorted(DTYPES))
@pytest.mark.parametrize("with_scratch", [False, True])
def test_counts_equal_torchs_isfinite_for_every_bit_pattern_class(tag: str, with_scratch: bool) -> None:
    dtype = DTYPES[tag]
    info = torch.finfo(dtype)
    edges = [0.0, -0.0, info.max, -info.max, info.tiny, -info.tiny, info.smallest_normal / 4, 1.0, -3.5]
    specials = [float("nan"), -float("nan")] + ([] if tag == "F8_E4M3" else [float("inf"), -float("inf")])
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor(edges, dtype=torch.float64), torch.randn(4000, generator=g).double() * 4]).to(
        dtype
    )
    values = values.repeat(3)
    at = torch.randperm(values.numel(), generator=g)[:37]
    values[at] = torch.tensor(specials * 37, dtype=torch.float64)[:37].to(dtype)
    raw = values.view(torch.uint8).numpy().tobytes()
    scratch = np.full(len(raw) + 64, 0xFF, dtype=np.uint8) if with_scratch else None  # dirty: must be overwritten
    expected = int((~torch.isfinite(values.to(torch.float64))).sum())
    assert expected == 37
    assert count_non_finite(raw, tag, scratch) == expected
    finite = values[torch.isfinite(values.to(torch.float64))]
    assert count_non_finite(finite.view(torch.uint8).numpy().tobytes(), tag, scratch) == 0


def test_non_float_dtypes_and_empty_data_count_nothing() -> None:
    assert count_non_finite(b"\xff" * 64, "I32") == 0
    assert count_non_finite(b"\xff" * 64, "U8") == 0
    assert count_non_finite(b"", "BF16") == 0
