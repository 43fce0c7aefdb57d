"""Turning SGLang ``POST /generate`` answers into validated completions.

SGLang answers a batch of ``input_ids`` with ``n`` samples each as one flat list ordered
prompt by prompt (p0 s0, p0 s1, p1 s0, ...). Each item carries ``output_ids`` and, with
``return_logprob``, ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text], ...]``
plus ``meta_info.weight_version``. Every token id is checked and coerced to a Python ``int``
here: a float token id that reached the trainer would become a float tensor and crash the
embedding lookup (the bug that sank an earlier TRL + SGLang attempt), so it must be impossible.

Every logprob (sampled or rescored) goes through :func:`parse_logprob`: a number <= 0, or None
where TRL then applies no correction (null, NaN, -inf); anything else (a string, +inf, a positive
value, i.e. a probability above 1) is refused. An answer that cannot be for the request it
answers (more tokens than ``max_new_tokens``, ``meta_info.prompt_tokens`` of another prompt
length) is refused too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_service.protocol import step_for_version
from rollout_service.shown_values import shown

LOGPROB_TOLERANCE = 1e-4
"""How far above 0 a logprob may be (float rounding of log 1) before it is refused as impossible."""
MAX_TOKEN_ID = 2**31
"""Token ids must stay below this when the model's vocabulary size is unknown (no model has more)."""
MAX_EXACT_FLOAT = 2**53
"""Above this a float is no exact integer: such a float token id is refused."""


class SGLangResponseError(RuntimeError):
    """SGLang answered something that is not a well-formed generation result."""


@dataclass
class Completion:
    """One sampled completion, validated.

    ``weight_version`` is the checkpoint version SGLang reported, read by
    :func:`parse_weight_version` (None when it reported no version: SGLang's start-up ``"default"``,
    i.e. weights no checkpoint put there, or a missing or malformed field; ``raw_weight_version``
    keeps what was there, None when missing).
    """

    token_ids: list[int]
    logprobs: list[float | None] | None
    weight_version: int | None
    raw_weight_version: str | None
    finish_reason: str | None = None

    def same_weights(self, other: Completion) -> bool:
        """Whether ``other`` was computed with the same weights (same version; else the same raw label)."""
        if self.weight_version is not None or other.weight_version is not None:
            return self.weight_version == other.weight_version
        return self.raw_weight_version == other.raw_weight_version


def coerce_token_id(value: Any, where: str, vocab_size: int | None = None) -> int:
    """Return ``value`` as an ``int`` token id, or raise saying what was found.

    Integers (also numpy integers) pass; floats pass only when integral (``5.0``) and exact (at
    most 2**53), so a serializer that turned ids into floats cannot leak float ids into the
    trainer; booleans, strings, non-integral or negative numbers and ids outside the vocabulary
    raise (ids from ``2**31`` on when ``vocab_size`` is unknown).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SGLangResponseError(
            f"{where}: expected an integer token id, found {shown(value)} ({type(value).__name__})"
        )
    if isinstance(value, numbers.Integral):
        token = int(value)
    else:
        number = float(value)
        if not math.isfinite(number) or not number.is_integer():
            raise SGLangResponseError(
                f"{where}: expected an integer token id, found the non-integral number {shown(value)}"
            )
        if abs(number) > MAX_EXACT_FLOAT:
            raise SGLangResponseError(f"{where}: the float {shown(value)} is too large to be an exact token id")
        token = int(number)
    if vocab_size is None:
        if not 0 <= token < MAX_TOKEN_ID:
            raise SGLangResponseError(
                f"{where}: token id {token} is outside [0, 2**31) (the model's vocabulary size is unknown, "
                "and no model has that many tokens)"
            )
    elif not 0 <= token < vocab_size:
        raise SGLangResponseError(
            f"{where}: token id {token} is outside the model's vocabulary [0, {vocab_size}); the SGLang "
            "server probably serves a different model than the trainer trains"
        )
    return token


def parse_weight_version(raw: Any) -> int | None:
    """The checkpoint version in ``meta_info.weight_version`` ("7" -> 7; "default", missing, 5.0,
    "5.0", " 5", true, [5] -> None): :func:`rollout_service.protocol.step_for_version`, the one
    parser the sidecars use too, so every component reads a label the same way."""
    return step_for_version(raw)


def parse_logprob(value: Any, where: str) -> float | None:
    """One logprob from SGLang as a float <= 0, or None where TRL gets no correction for the token.

    None and NaN are None. -inf (probability 0 for a token that was sampled or scored) is None
    too: TRL's ratio would be infinite, so that token gets no correction rather than a wrong one.
    Strings, booleans, +inf and values above ``LOGPROB_TOLERANCE`` (a probability above 1) raise.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SGLangResponseError(f"{where}: expected a number as logprob, found {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range: no server's logprob
        raise SGLangResponseError(
            f"{where}: logprob is an integer of {value.bit_length() if isinstance(value, int) else '?'} bits, past"
            " any float; the server's logprobs are corrupt"
        ) from None
    if number > LOGPROB_TOLERANCE:
        raise SGLangResponseError(
            f"{where}: logprob {number!r} is impossible (a probability above 1); the server's logprobs are corrupt"
        )
    return number if number > -math.inf else None  # NaN and -inf -> None


def parse_generate_response(
    data: Any,
    *,
    num_prompts: int,
    n: int,
    want_logprobs: bool,
    vocab_size: int | None = None,
    source: str = "SGLang",
    prompt_lengths: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
) -> list[list[Completion]]:
    """Split SGLang's flat answer into ``num_prompts`` groups of ``n`` validated completions.

    ``prompt_lengths`` (per prompt) and ``max_new_tokens``, when given, are checked against each
    result (``meta_info.prompt_tokens`` where present, the number of output ids)."""
    _raise_if_error_object(data, source)
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
            where = f"{source} result {p * n + s} (prompt {p}, sample {s})"
            completion = _parse_item(item, where, want_logprobs, vocab_size, max_new_tokens)
            if prompt_lengths is not None:
                _check_prompt_tokens(item, prompt_lengths[p], where)
            group.append(completion)
        groups.append(group)
    return groups


def parse_rescore_response(data: Any, *, count: int, vocab_size: int | None = None, source: str) -> list[Completion]:
    """Read a prefill-only rescoring answer (``max_new_tokens=0``, ``logprob_start_len``) for
    ``count`` sequences: per sequence, the token ids of ``meta_info.input_token_logprobs`` (from
    ``logprob_start_len`` on), their logprobs and the weight version, as a :class:`Completion`.
    A malformed answer raises :class:`SGLangResponseError`, as :func:`parse_generate_response` does."""
    _raise_if_error_object(data, source)
    if isinstance(data, dict) and count == 1:
        data = [data]
    if not isinstance(data, list) or len(data) != count:
        found = f"{len(data)} results" if isinstance(data, list) else f"a {type(data).__name__}"
        raise SGLangResponseError(f"{source} answered {found} for {count} sequences to rescore: {str(data)[:300]}")
    out = []
    for k, item in enumerate(data):
        where = f"{source} result {k}"
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            raise SGLangResponseError(
                f"{where}: expected a JSON object with a meta_info object, found {str(item)[:200]}"
            )
        entries = meta.get("input_token_logprobs")
        if not isinstance(entries, list):
            raise SGLangResponseError(
                f"{where}: meta_info.input_token_logprobs is {str(entries)[:200]}, expected a list although "
                "return_logprob was requested"
            )
        fast = all(type(e) is list and len(e) >= 2 for e in entries)  # what SGLang sends: one pass each
        token_ids = _token_ids([e[1] for e in entries], f"{where} input_token_logprobs", vocab_size) if fast else []
        logprobs = _fast_logprobs(entries, token_ids) if fast else None
        if logprobs is None:  # entry by entry, for a message naming the bad one
            token_ids, logprobs = [], []
            for i, entry in enumerate(entries):
                at = f"{where} input_token_logprobs[{i}]"
                if not isinstance(entry, (list, tuple)) or len(entry) < 2:
                    raise SGLangResponseError(f"{at} is {shown(entry)}, expected [logprob, token_id, ...]")
                token_ids.append(coerce_token_id(entry[1], at, vocab_size))
                logprobs.append(parse_logprob(entry[0], at))
        raw_version = meta.get("weight_version")
        out.append(
            Completion(
                token_ids=token_ids,
                logprobs=logprobs,
                weight_version=parse_weight_version(raw_version),
                raw_weight_version=_raw_version(raw_version),
            )
        )
    return out


def _raise_if_error_object(data: Any, source: str) -> None:
    """Raise quoting the server's message when ``data`` is an error object (``{"object": "error",
    "message": ...}`` or ``{"error": ...}``) rather than results."""
    if not isinstance(data, dict) or "meta_info" in data or "output_ids" in data:
        return
    if data.get("object") != "error" and "error" not in data:
        return
    error = data.get("error")
    message = data.get("message") or (error.get("message") if isinstance(error, dict) else error) or data
    raise SGLangResponseError(f"{source} answered HTTP 200 with an error instead of results: {str(message)[:1000]}")


def _check_prompt_tokens(item: dict[str, Any], length: int, where: str) -> None:
    """``meta_info.prompt_tokens``, where SGLang reports it, must be the length of the prompt sent."""
    reported = item["meta_info"].get("prompt_tokens")
    if reported is not None and (isinstance(reported, bool) or reported != length):
        raise SGLangResponseError(
            f"{where}: meta_info.prompt_tokens is {shown(reported)} but the prompt sent has {length} tokens; "
            "the answer is for another prompt"
        )


def _parse_item(
    item: Any, where: str, want_logprobs: bool, vocab_size: int | None, max_new_tokens: int | None = None
) -> Completion:
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
    if max_new_tokens is not None and len(raw_ids) > max_new_tokens:
        raise SGLangResponseError(
            f"{where}: {len(raw_ids)} output ids for max_new_tokens={max_new_tokens}; the answer is not for "
            "this request"
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
    if not token_ids and finish != "abort":  # (an aborted one is generated again)
        raise SGLangResponseError(
            f"{where}: no output ids (finish_reason {shown(finish, 40)}), although every request asks for at least"
            " one token; TRL cannot train on an empty completion. Check the SGLang server behind this URL"
        )
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        weight_version=parse_weight_version(raw_version),
        raw_weight_version=_raw_version(raw_version),
        finish_reason=finish if isinstance(finish, str) else None,
    )


def _raw_version(value: Any) -> str | None:
    """A ``meta_info.weight_version`` as text for comparisons and messages: bounded, whatever it holds."""
    if value is None:
        return None
    if isinstance(value, str) and len(value) <= 64:
        return value
    if isinstance(value, int) and value.bit_length() <= 64:
        return str(value)
    return shown(value, 64)


def _token_ids(raw: list[Any], where: str, vocab_size: int | None) -> list[int]:
    """``raw`` as validated ints: one pass over exact ints in range (what SGLang sends), else
    token by token through :func:`coerce_token_id` for a message naming the bad one."""
    limit = MAX_TOKEN_ID if vocab_size is None else vocab_size
    if all(type(t) is int for t in raw) and (not raw or (min(raw) >= 0 and max(raw) < limit)):
        return list(raw)
    return [coerce_token_id(t, f"{where}[{i}]", vocab_size) for i, t in enumerate(raw)]


def _fast_logprobs(entries: list[Any], token_ids: list[int]) -> list[float | None] | None:
    """The logprobs when every entry is a well-formed ``[float <= tolerance, <the output id>, ...]``
    (what :func:`parse_logprob` would give); None sends the caller to the entry-by-entry checks
    (and their error messages)."""
    if not all(type(e) is list and len(e) >= 2 and type(e[1]) is int and type(e[0]) is float for e in entries):
        return None
    if [e[1] for e in entries] != token_ids:
        return None
    logprobs: list[float] = [e[0] for e in entries]
    if any(lp > LOGPROB_TOLERANCE for lp in logprobs):
        return None
    return [lp if lp > -math.inf else None for lp in logprobs]  # NaN and -inf -> None


def _checked_logprobs(
    entries: list[Any], token_ids: list[int], where: str, vocab_size: int | None
) -> list[float | None]:
    """Entry by entry, raising on the first malformed one with its index."""
    logprobs: list[float | None] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise SGLangResponseError(
                f"{where}: output_token_logprobs[{i}] is {shown(entry)}, expected [logprob, token_id, ...]"
            )
        token = coerce_token_id(entry[1], f"{where} output_token_logprobs[{i}]", vocab_size)
        if token != token_ids[i]:
            raise SGLangResponseError(
                f"{where}: output_token_logprobs[{i}] is for token {token}, output_ids[{i}] is {token_ids[i]}"
            )
        logprobs.append(parse_logprob(entry[0], f"{where} output_token_logprobs[{i}]"))
    return logprobs
