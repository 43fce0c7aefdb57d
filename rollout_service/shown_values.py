"""Quoting untrusted values (parsed JSON from an ack file, a sidecar's or SGLang's answer, names
read under the checkpoint root) in messages and logs: bounded in length, never walking into the
value, and never carrying a control character.

``repr()`` and ``str()`` of parsed JSON recurse into it: a list nested a few hundred deep (it
parses on a fresh thread's shallow stack) raises ``RecursionError`` when quoted from deep inside
a trainer, and a 5 MB string becomes a 5 MB exception message broadcast to every process.
:func:`shown` describes a container by its size and cuts text, so quoting never fails.

A name from the root (a file name, a tensor name in a safetensors header, a manifest string) can
hold a newline, a carriage return or a terminal escape: quoted raw, a file named
``x\\n2030-01-01 ... INFO ...: loaded step 99`` forges a log line, and ``\\x1b[2K`` rewrites the
terminal. :func:`escape_controls` shows such characters as visible escapes; :func:`shown_text` (so
every ``CheckpointError``), :class:`ShownLogFormatter` (the CLI's log lines) and the CLI's printed
lines go through it.
"""

from __future__ import annotations

import copy
import logging
import numbers
import re
from typing import Any

SHOWN_CHARS = 80

_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
"""What :func:`escape_controls` escapes: C0 controls (newline, carriage return, tab, ESC, NUL...),
DEL, C1 controls (``\\x85`` too), the Unicode line and paragraph separators, the bidi controls that
reorder what a terminal shows (embeddings, overrides, isolates, marks), and lone surrogates (a
name that is not UTF-8, as ``os.fsdecode`` gives it, which no strict stream can write)."""
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """``text`` with every control character (:data:`_CONTROLS`) shown as a visible escape, as
    ``repr`` writes it (``\\n``, ``\\x1b``, ``\\u2028``), so that it is one line that changes
    nothing on a terminal; everything else (non-ASCII letters, quotes, backslashes) as it is."""
    return _CONTROLS.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


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
    """``value`` as text for a message: a string itself, cut to ``limit`` characters, its control
    characters escaped (:func:`escape_controls`); anything else as :func:`shown` describes it."""
    if isinstance(value, str):
        return escape_controls(value if len(value) <= limit else value[:limit] + "...")
    return escape_controls(shown(value, limit))


LOG_CONTINUATION = "\n    | "
"""What starts each further line of a log record's message (SGLang's last log lines in a start
error, a newline in a name): a line that cannot pass for a record of its own."""


class ShownLogFormatter(logging.Formatter):
    """A log formatter for lines that quote untrusted values: each record's message (its format
    and arguments, the only parts that can hold them) shown by :func:`escape_controls`, line by
    line, each line after the first starting with :data:`LOG_CONTINUATION`, so that no message
    can forge a record (a record starts at the line's start, with its time) nor reach the
    terminal's controls, while a message of several lines (SGLang's log tail) stays readable; a
    traceback (``exc_info``, ``stack_info``) follows it on lines of its own, as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        shown_record = copy.copy(record)  # other handlers format the record as it was
        lines = record.message.split("\n")
        shown_record.message = LOG_CONTINUATION.join(escape_controls(line) for line in lines)
        return super().formatMessage(shown_record)


def _flat(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, (bool, numbers.Number))
        or (isinstance(value, str) and len(value) <= SHOWN_CHARS)
    )
