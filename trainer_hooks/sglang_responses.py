"""Turning SGLang ``POST /generate`` answers into validated completions.

SGLang answers a batch of ``input_ids`` with ``n`` samples each as one flat list ordered
prompt by prompt (p0 s0, p0 s1, p1 s0, ...). Each item carries ``output_ids`` and, with
``return_logprob``, ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text], ...]``
plus ``meta_info.weight_version``. Every token id is checked and coerced to a Python ``int``
here: a float token id that reached the trainer would become a float tensor and crash the
embedding lookup (the bug that sank an earlier TRL + SGLang attempt), so it must be impossible.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from rollout_service.protocol import step_for_version


class SGLangResponseError(RuntimeError):
    """SGLang answered something that is not a well-formed generation result."""


@dataclass
class Completion:
    """One sampled completion, validated.

    ``weight_version`` is the checkpoint version SGLang reported (None when it reported a
    non-numeric version such as ``"default"``, i.e. weights no checkpoint put there).
    """

    token_ids: list[int]
    logprobs: list[float | None] | None
    weight_version: int | None
    raw_weight_version: str | None
    finish_reason: str | None = None


def coerce_token_id(value: Any, where: str, vocab_size: int | None = None) -> int:
    """Return ``value`` as an ``int`` token id, or raise saying what was found.

    Integers (also numpy integers) pass; floats pass only when integral (``5.0``), so a
    serializer that turned ids into floats cannot leak float ids into the trainer; booleans,
    strings, non-integral or negative numbers and ids outside the vocabulary raise.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SGLangResponseError(f"{where}: expected an integer token id, found {value!r} ({type(value).__name__})")
    if isinstance(value, numbers.Integral):
        token = int(value)
    else:
        number = float(value)
        if not math.isfinite(number) or not number.is_integer():
            raise SGLangResponseError(f"{where}: expected an integer token id, found the non-integral number {value!r}")
        token = int(number)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise SGLangResponseError(
            f"{where}: token id {token} is outside the model's vocabulary [0, {vocab_size}); the SGLang "
            "server probably serves a different model than the trainer trains"
        )
    return token


def parse_weight_version(raw: Any) -> int | None:
    """The checkpoint version in ``meta_info.weight_version`` ("7" -> 7; "default" -> None)."""
    return step_for_version(raw.strip() if isinstance(raw, str) else raw)


def parse_generate_response(
    data: Any,
    *,
    num_prompts: int,
    n: int,
    want_logprobs: bool,
    vocab_size: int | None = None,
    source: str = "SGLang",
) -> list[list[Completion]]:
    """Split SGLang's flat answer into ``num_prompts`` groups of ``n`` validated completions."""
    if isinstance(data, dict) and num_prompts * n == 1:
        data = [data]
    if not isinstance(data, list):
        raise SGLangResponseError(
            f"{source} answered a {type(data).__name__} to a batched /generate, expected a list of "
            f"{num_prompts * n} results: {str(data)[:300]}"
        )
    if len(data) != num_prompts * n:
        raise SGLangResponseError(
            f"{source} answered {len(data)} results for {num_prompts} prompts x n={n}, expected {num_prompts * n}"
        )
    groups: list[list[Completion]] = []
    for p in range(num_prompts):
        group = []
        for s in range(n):
            item = data[p * n + s]
            group.append(
                _parse_item(item, f"{source} result {p * n + s} (prompt {p}, sample {s})", want_logprobs, vocab_size)
            )
        groups.append(group)
    return groups


def _parse_item(item: Any, where: str, want_logprobs: bool, vocab_size: int | None) -> Completion:
    if not isinstance(item, dict):
        raise SGLangResponseError(f"{where}: expected a JSON object, found {type(item).__name__}")
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangResponseError(f"{where}: the result has no meta_info object")
    raw_ids = item.get("output_ids")
    if not isinstance(raw_ids, list):
        raise SGLangResponseError(
            f"{where}: expected 'output_ids' to be a list of token ids, found {type(raw_ids).__name__}; "
            "the trainer sends input_ids and needs token ids back (use SGLang >= 0.5)"
        )
    token_ids = _token_ids(raw_ids, f"{where} output_ids", vocab_size)
    logprobs: list[float | None] | None = None
    if want_logprobs:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise SGLangResponseError(
                f"{where}: meta_info.output_token_logprobs is missing although return_logprob was requested"
            )
        if len(entries) != len(token_ids):
            raise SGLangResponseError(
                f"{where}: {len(entries)} token logprobs for {len(token_ids)} output ids; they must match"
            )
        logprobs = _fast_logprobs(entries, token_ids)
        if logprobs is None:
            logprobs = _checked_logprobs(entries, token_ids, where, vocab_size)
    raw_version = meta.get("weight_version")
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):
        finish = finish.get("type")
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        weight_version=parse_weight_version(raw_version),
        raw_weight_version=None if raw_version is None else str(raw_version),
        finish_reason=finish if isinstance(finish, str) else None,
    )


def _token_ids(raw: list[Any], where: str, vocab_size: int | None) -> list[int]:
    """``raw`` as validated ints: one pass over exact ints in range (what SGLang sends), else
    token by token through :func:`coerce_token_id` for a message naming the bad one."""
    if all(type(t) is int for t in raw) and (
        not raw or (min(raw) >= 0 and (vocab_size is None or max(raw) < vocab_size))
    ):
        return list(raw)
    return [coerce_token_id(t, f"{where}[{i}]", vocab_size) for i, t in enumerate(raw)]


def _fast_logprobs(entries: list[Any], token_ids: list[int]) -> list[float | None] | None:
    """The logprobs when every entry is a well-formed ``[float, <the output id>, ...]``; None
    sends the caller to the entry-by-entry checks (and their error messages)."""
    if not all(type(e) is list and len(e) >= 2 and type(e[1]) is int and type(e[0]) is float for e in entries):
        return None
    if [e[1] for e in entries] != token_ids:
        return None
    return [None if e[0] != e[0] else e[0] for e in entries]  # NaN -> None


def _checked_logprobs(
    entries: list[Any], token_ids: list[int], where: str, vocab_size: int | None
) -> list[float | None]:
    """Entry by entry, raising on the first malformed one with its index."""
    logprobs: list[float | None] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise SGLangResponseError(
                f"{where}: output_token_logprobs[{i}] is {entry!r}, expected [logprob, token_id, ...]"
            )
        token = coerce_token_id(entry[1], f"{where} output_token_logprobs[{i}]", vocab_size)
        if token != token_ids[i]:
            raise SGLangResponseError(
                f"{where}: output_token_logprobs[{i}] is for token {token}, output_ids[{i}] is {token_ids[i]}"
            )
        logprobs.append(_logprob(entry[0], f"{where} output_token_logprobs[{i}]"))
    return logprobs


def _logprob(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SGLangResponseError(f"{where}: expected a number as logprob, found {value!r}")
    number = float(value)
    return None if math.isnan(number) else number
