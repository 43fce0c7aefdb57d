"""Quoting untrusted values (parsed JSON from an ack file, a sidecar's or SGLang's answer) in
messages and logs: bounded in length, and never walking into the value.

``repr()`` and ``str()`` of parsed JSON recurse into it: a list nested a few hundred deep (it
parses on a fresh thread's shallow stack) raises ``RecursionError`` when quoted from deep inside
a trainer, and a 5 MB string becomes a 5 MB exception message broadcast to every process.
:func:`shown` describes a container by its size and cuts text, so quoting never fails.
"""

from __future__ import annotations

import numbers
from typing import Any

SHOWN_CHARS = 80


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as a message may quote it: ``repr`` of a number, ``None`` or a string (cut to
    ``limit`` characters), a flat list of at most 8 such values, else what it is and its size."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, numbers.Number):
        return repr(value)[:limit]
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and all(_flat(v) for v in value):
            text = "[" + ", ".join(shown(v, limit) for v in value) + "]"
            return text if len(text) <= 2 * limit else f"a list of {len(value)} values"
        return f"a list of {len(value)} values"
    if isinstance(value, dict):
        return f"a JSON object of {len(value)} keys"
    return f"a {type(value).__name__}"


def shown_text(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as text for a message: a string itself, cut to ``limit`` characters; anything
    else as :func:`shown` describes it."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    return shown(value, limit)


def _flat(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, (bool, numbers.Number))
        or (isinstance(value, str) and len(value) <= SHOWN_CHARS)
    )
