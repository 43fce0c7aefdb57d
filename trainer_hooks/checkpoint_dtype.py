"""The dtype the trainer's checkpoints are written in.

:func:`checkpoint_dtype` picks its name once, at start-up (the ``checkpoint_dtype`` setting, else
the model's configured dtype, else its first floating parameter's); :func:`target_dtype` is the
torch dtype a name stands for, which the publishers cast floating tensors to before copying them.
"""

from __future__ import annotations

import torch

from rollout_service.checkpoint_format import normalize_dtype

_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
"""torch's names of the safetensors tags (what ``normalize_dtype`` returns) a model may be in."""

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""safetensors tags of the dtypes checkpoints may be cast to."""


def checkpoint_dtype(requested: str | None, model: torch.nn.Module) -> str:
    """The dtype name checkpoints are written in: the requested one, else the model's configured one."""
    if requested is not None:
        return _DTYPE_NAMES[normalize_dtype(requested)]  # type: ignore[index]
    configured = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(configured, torch.dtype):
        configured = str(configured).removeprefix("torch.")
    if isinstance(configured, str) and configured not in ("auto", ""):
        try:
            return _DTYPE_NAMES[normalize_dtype(configured)]  # type: ignore[index]
        except (KeyError, ValueError):
            pass
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return "float32"


def target_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a checkpoint dtype name ("bfloat16", "bf16", ...), None to keep each tensor's."""
    if name is None:
        return None
    return _FLOAT_DTYPES[normalize_dtype(name)]  # type: ignore[index]
