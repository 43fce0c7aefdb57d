"""The dtypes checkpoints are published in, defined once: ``publish --dtype`` and the trainer's
``checkpoint_dtype`` (``trainer_hooks.checkpoint_dtype``) accept these and nothing else.

SGLang serves bfloat16, float16 and float32 weights; a checkpoint in another floating dtype
(float64, float8) would be cast on load into something the trainer did not train, so a model in
one is published in the dtype SGLang serves, named by the user.
"""

from __future__ import annotations

import argparse

from .checkpoint_format import DTYPE_NAME_OF_TAG, normalize_dtype

PUBLISHABLE_DTYPES = ("bfloat16", "float16", "float32")
"""The dtype names checkpoints can be published in (``bf16``, ``half``, ... are other spellings)."""

_NAME_OF_TAG = {tag: name for tag, name in DTYPE_NAME_OF_TAG.items() if name in PUBLISHABLE_DTYPES}
"""The safetensors tag of each of :data:`PUBLISHABLE_DTYPES`, and its name."""

NOT_PUBLISHABLE = (
    f"is not a dtype checkpoints can be published in: use one of {', '.join(PUBLISHABLE_DTYPES)}"
    " (or bf16, fp16, half, fp32)"
)
"""What an error says of a dtype name outside :data:`PUBLISHABLE_DTYPES`, after the name."""


def publishable_dtype(name: object, field: str = "checkpoint_dtype") -> str:
    """``name`` as one of :data:`PUBLISHABLE_DTYPES` (any spelling ``normalize_dtype`` accepts);
    a ValueError naming ``field``, the value and the allowed dtypes otherwise."""
    tag = None
    if isinstance(name, str):
        try:
            tag = normalize_dtype(name)
        except ValueError:
            tag = None
    if tag not in _NAME_OF_TAG:
        raise ValueError(f"{field}={name!r} {NOT_PUBLISHABLE}")
    return _NAME_OF_TAG[tag]


def publishable_dtype_argument(text: str) -> str:
    """The argparse ``type`` of ``publish --dtype``: :func:`publishable_dtype`, its refusal an
    ``ArgumentTypeError`` so that argparse shows why (``argument --dtype: 'float64' is not ...``)."""
    try:
        return publishable_dtype(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} {NOT_PUBLISHABLE}") from None
