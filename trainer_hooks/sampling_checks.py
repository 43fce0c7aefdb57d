"""The values of SGLang sampling parameters, checked when the config is made: ``generation_kwargs``
and TRL's own sampling fields (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``max_completion_length``) as they reach SGLang.

SGLang 0.5.23 refuses a request whose sampling parameters are out of range (``SamplingParams.verify``)
with HTTP 400, which the trainer meets only at its first generation step, after the model loaded;
a value of the wrong type (``min_new_tokens="5"``) can crash the trainer's own logic first, and some
crash SGLang itself (a grammar given as a dict: its grammar cache key cannot hash it; a
``stop_token_ids`` entry outside the vocabulary with ``min_new_tokens > 0``). The same ranges and
types are checked here, so that a bad value is a ``ValueError`` naming the setting at start; token
ids are checked against the model's vocabulary once it is known (:func:`check_token_ids_in_vocab`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_TOKEN_ID = 2**31
"""Token ids are below this (SGLang's vocabularies are far smaller; the exact size is the server's)."""


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_whole(t) and 0 <= t < MAX_TOKEN_ID for t in v)


def _strings(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _token_id_key(key: Any) -> int | None:
    """A ``logit_bias`` key as a token id (a whole number from 0 below :data:`MAX_TOKEN_ID`, or its
    decimal string); None if it is none."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    return int(key) if _whole(key) and 0 <= key < MAX_TOKEN_ID else None


def _logit_bias(v: Any) -> bool:
    """SGLang's ``logit_bias``: token id -> a finite bias (it calls ``int()`` on each key)."""
    return isinstance(v, dict) and all(_token_id_key(k) is not None and _finite(b) for k, b in v.items())


def _json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v))


def _custom_params(v: Any) -> bool:
    """SGLang's ``custom_params``: string keys, each value a JSON scalar or a list / dict of them."""

    def value(x: Any) -> bool:
        if isinstance(x, list):
            return all(_json_scalar(i) for i in x)
        if isinstance(x, dict):
            return all(isinstance(k, str) and _json_scalar(i) for k, i in x.items())
        return _json_scalar(x)

    return isinstance(v, dict) and all(isinstance(k, str) and value(x) for k, x in v.items())


_SWITCH = (lambda v: isinstance(v, bool), "true or false")
_TEXT = (lambda v: isinstance(v, str), "a string (SGLang takes the grammar as text)")

RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (
        lambda v: _whole(v) and v >= 1,
        "a whole number >= 1 (TRL reads each completion's last token: an empty one cannot be trained on)",
    ),
    "min_new_tokens": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
    "temperature": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "top_k": (lambda v: _whole(v) and (v == -1 or v >= 1), "-1 (no limit) or a whole number >= 1"),
    "frequency_penalty": (lambda v: _finite(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "presence_penalty": (lambda v: _finite(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (lambda v: _finite(v) and 0 < v <= 2, "a number in (0, 2]"),
    "stop_token_ids": (_token_ids, f"a list of token ids (whole numbers from 0 below {MAX_TOKEN_ID})"),
    "stop": (_strings, "a string or a list of strings"),
    "stop_regex": (_strings, "a string or a list of strings (regular expressions)"),
    "regex": _TEXT,
    "ebnf": _TEXT,
    "json_schema": (_TEXT[0], "a string: the schema as JSON text, json.dumps(schema)"),
    "structural_tag": (_TEXT[0], "a string: the structural tag as JSON text, json.dumps(tag)"),
    "logit_bias": (
        _logit_bias,
        'a dict of token id -> bias, e.g. {"50256": -100.0} (each key a token id: a whole number from 0, or its'
        " decimal string; each bias a finite number)",
    ),
    "custom_params": (
        _custom_params,
        "a dict with string keys whose values are JSON values (null, true/false, a number, a string, or a list or"
        " dict of those)",
    ),
    "stream_interval": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "ignore_eos": _SWITCH,
    "skip_special_tokens": _SWITCH,
    "spaces_between_special_tokens": _SWITCH,
    "no_stop_trim": _SWITCH,
}
"""Per SGLang parameter: whether a value is one SGLang takes, and what it must be. None (SGLang's
default) is always fine; parameters not listed are left to SGLang."""


def check_sampling_values(
    params: dict[str, Any], named: dict[str, str] | None = None, fields: dict[str, str] | None = None
) -> None:
    """``ValueError`` naming the first parameter of ``params`` (SGLang names) whose value SGLang
    would refuse. ``named`` maps an SGLang name to the name the user gave it in ``generation_kwargs``
    (``eos_token_id``); ``fields`` maps an SGLang name to the TRL config field its value came from
    (``max_new_tokens`` -> ``max_completion_length``), so the message names the setting to change."""
    named = named or {}
    fields = fields or {}

    def label(key: str) -> str:
        given = fields.get(key) or named.get(key, key)
        alias = f" (SGLang's {key})" if given != key else ""
        return f"{given}{alias}" if key in fields else f"generation_kwargs {given}{alias}"

    for key, value in params.items():
        rule = RULES.get(key)
        if rule is None or value is None or rule[0](value):
            continue
        raise ValueError(f"{label(key)} must be {rule[1]}, got {value!r:.80}")
    low, high = params.get("min_new_tokens"), params.get("max_new_tokens")
    if low is not None and high is not None and low > high:
        ceiling = fields.get("max_new_tokens", "max_new_tokens")
        raise ValueError(
            f"generation_kwargs min_new_tokens={low} is above {ceiling}={high}: lower min_new_tokens or raise {ceiling}"
        )


def check_token_ids_in_vocab(params: dict[str, Any], vocab_size: int | None) -> None:
    """``ValueError`` naming the first ``stop_token_ids`` entry or ``logit_bias`` key of ``params``
    (SGLang's names) outside the model's vocabulary (``0 .. vocab_size - 1``); nothing when
    ``vocab_size`` is not known. SGLang 0.5.23 refuses such a ``logit_bias`` key with HTTP 400 at the
    first step, and such a stop token with ``min_new_tokens > 0`` kills the server (its penalizer
    indexes out of bounds); without it, the stop token can never be sampled."""
    if vocab_size is None:
        return
    ids = [("stop_token_ids", t) for t in params.get("stop_token_ids") or [] if _whole(t)]
    ids += [("logit_bias", _token_id_key(k)) for k in params.get("logit_bias") or {}]
    for key, token in ids:
        if token is not None and not 0 <= token < vocab_size:
            raise ValueError(
                f"generation_kwargs {key} has token id {token}, outside the model's vocabulary (0 .. {vocab_size - 1}):"
                f" use token ids below its vocab_size {vocab_size} (the tokenizer's, e.g. tokenizer.eos_token_id)"
            )
