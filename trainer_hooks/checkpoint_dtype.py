"""The dtype the trainer's checkpoints are written in.

:func:`checkpoint_dtype` picks its name once, at start-up (the ``checkpoint_dtype`` setting, else
the model's configured dtype, else its first floating parameter's); :func:`target_dtype` is the
torch dtype a name stands for, which the publishers cast floating tensors to before copying them.
Checkpoints are published in :data:`PUBLISHABLE_DTYPES` only (defined in
``rollout_service.publish_dtypes``, which ``publish --dtype`` uses too): a model in another dtype
(float64, float8) needs ``checkpoint_dtype`` set to the one SGLang serves.
"""

from __future__ import annotations

import torch

from rollout_service.checkpoint_format import DTYPE_NAME_OF_TAG, normalize_dtype
from rollout_service.publish_dtypes import PUBLISHABLE_DTYPES as PUBLISHABLE_DTYPES  # defined once, there
from rollout_service.publish_dtypes import publishable_dtype as publishable_dtype

_TORCH_DTYPES = {name: getattr(torch, name) for name in PUBLISHABLE_DTYPES}
"""The torch dtype of each of :data:`PUBLISHABLE_DTYPES`."""


def checkpoint_dtype(requested: str | None, model: torch.nn.Module) -> str:
    """The dtype name checkpoints are written in: the requested one, else the model's configured one.

    A model in a dtype checkpoints cannot be published in (float64) raises a ValueError asking for
    ``checkpoint_dtype``: the default stands for what SGLang serves, which is then not known.
    """
    if requested is not None:
        return publishable_dtype(requested)
    found = _model_dtype(model)
    if found not in PUBLISHABLE_DTYPES:
        raise ValueError(
            f"the model is in {found}, which checkpoints cannot be published in: set checkpoint_dtype to the "
            f"dtype SGLang serves (its --dtype), one of {', '.join(PUBLISHABLE_DTYPES)}, e.g. "
            "checkpoint_dtype='float32'"
        )
    return found


def _model_dtype(model: torch.nn.Module) -> str:
    """The model's configured dtype, else its first floating parameter's, else float32.

    A model cast to a narrower dtype after loading (``from_pretrained`` in float32, then
    ``.to(torch.bfloat16)``) keeps the loaded dtype in its config: when every floating parameter
    is in one narrower dtype, that one is taken (the wider checkpoint would hold the same values
    in twice the bytes). Wider parameters than the config says (float32 masters under mixed
    precision) leave the configured dtype, which is what the model is served in.
    """
    held = {p.dtype for p in model.parameters() if p.is_floating_point()}
    configured = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(configured, torch.dtype):
        configured = str(configured).removeprefix("torch.")
    if isinstance(configured, str) and configured not in ("auto", ""):
        try:
            name = DTYPE_NAME_OF_TAG[normalize_dtype(configured)]  # type: ignore[index]
        except (KeyError, ValueError):
            pass
        else:
            if len(held) == 1:
                (only,) = held
                narrower = str(only).removeprefix("torch.")
                if narrower in PUBLISHABLE_DTYPES and only.itemsize < getattr(torch, name).itemsize:
                    return narrower
            return name
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return "float32"


def target_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a checkpoint dtype name ("bfloat16", "bf16", ...), None to keep each tensor's."""
    if name is None:
        return None
    return _TORCH_DTYPES[publishable_dtype(name, "dtype")]
