"""Numbers read from text: plain ASCII decimal, or refused with the text named.

Python's ``int()`` and ``float()`` read more than a person means by a number: ``"7_0"`` is 70,
``"٧"`` (an Arabic-Indic digit) is 7, ``"²"`` passes ``str.isdigit()`` and then fails ``int()``.
A number that comes from a flag, an environment variable, a request parameter or a header is
read here instead, so a typo or a forged value is refused rather than taken for another number.
Surrounding whitespace and a sign stay allowed where a person types the number (flags and
variables); a request's step (:data:`STEP_PATTERN`) is bare digits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

MAX_STEP_DIGITS = 8
STEP_PATTERN = rf"[0-9]{{1,{MAX_STEP_DIGITS}}}"
"""A checkpoint step as text (matched whole): ASCII digits only (``step-00000012``'s number,
a weight version, ``/wait?version=``)."""
_STEP_RE = re.compile(STEP_PATTERN, re.ASCII)
_SPACES = " \t\r\n"
"""What may surround a typed number (ASCII only: ``str.strip()`` would also take NBSP and U+3000)."""
_INT_RE = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)
_SECONDS = r"(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,4})?"
_SECONDS_RE = re.compile(_SECONDS, re.ASCII)
_FLOAT_RE = re.compile(rf"[+-]?(?:{_SECONDS}|nan|inf|infinity)", re.ASCII | re.IGNORECASE)


def step_from_text(text: object) -> int | None:
    """The step ``text`` writes in 1-8 ASCII digits, or None for anything else."""
    return int(text) if isinstance(text, str) and _STEP_RE.fullmatch(text) else None


def digits_value(text: str) -> int | None:
    """A header's non-negative number (``Content-Length``: 1-19 ASCII digits), or None."""
    return int(text) if 0 < len(text) <= 19 and text.isascii() and text.isdigit() else None


def plain_seconds(value: Any) -> Any:
    """A request's duration as sent, checked before pydantic reads it as a float (which takes
    ``"1_0"`` for 10): a non-negative decimal number in ASCII digits. Raises ValueError."""
    if isinstance(value, str) and not _SECONDS_RE.fullmatch(value):
        raise ValueError("must be a number of seconds in plain decimal digits, like 60 or 2.5")
    return value


def whole_number(text: str) -> int:
    """An integer typed by a person: an optional sign and ASCII digits (spaces around allowed).

    Raises ValueError otherwise (argparse then reports ``invalid int value: '7_0'``)."""
    stripped = text.strip(_SPACES)
    if not _INT_RE.fullmatch(stripped):
        raise ValueError(f"not a whole number in plain digits: {text!r}")
    return int(stripped)


def decimal_number(text: str) -> float:
    """A number typed by a person: decimal digits, an optional fraction and exponent (or
    ``nan``/``inf``, which a range check then refuses as not finite, naming the range).

    Raises ValueError for anything else, ``1_000`` included (argparse then reports
    ``invalid float value: '1_000'``)."""
    stripped = text.strip(_SPACES)
    if not _FLOAT_RE.fullmatch(stripped):
        raise ValueError(f"not a decimal number: {text!r}")
    return float(stripped)


def text_parser(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """The text -> number function for ``int`` and ``float`` here; any other ``kind`` itself."""
    if kind is int:
        return whole_number
    if kind is float:
        return decimal_number
    return kind


whole_number.__name__ = "int"  # argparse's "invalid int value: ..." names the kind by __name__
decimal_number.__name__ = "float"
