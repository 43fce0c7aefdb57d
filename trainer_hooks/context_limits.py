"""How many new tokens an SGLang server lets each prompt have, so that one long prompt does not
fail a whole batch.

SGLang 0.5.23 refuses a whole ``POST /generate`` (HTTP 400, "Requested token count exceeds the
model's maximum context length") when any one prompt's length plus ``max_new_tokens`` exceeds the
model's context length (``TokenizerManager._validate_one_request``). vLLM, behind TRL's own server
mode, instead generates such a prompt up to the context length and reports the completion as
truncated (no EOS: ``mask_truncated_completions`` applies). TRL sends one ``max_completion_length``
for every prompt, and its tool loop sends prompt + completion + tool result again with the same
budget, so near-limit prompts are normal there. :meth:`ContextLimits.caps` gives each prompt the
``max_new_tokens`` that fits, as vLLM does.

SGLang's scheduler refuses any *input* from ``max_req_input_len`` tokens on (the context length
less a few tokens of its own, or less when the KV cache is smaller): such a prompt cannot be
served at all, and the request is refused here, naming it, before it is sent
(:class:`PromptTooLong`). A rescore (``SGLangEndpoints``'s prefill-only request of prompt +
completion) is an input too: with rescoring, completions are capped so that prompt + completion
stays under it, except where that leaves a prompt no new token (it then gets what fits the context,
and its completion is not rescored: no importance-sampling correction for it, as
:meth:`ContextLimits.rescorable` says). A cap never goes below 1, nor ``min_new_tokens`` above its
prompt's cap (SGLang would refuse the batch).

With speculative decoding SGLang counts its draft slots on top of each input
(:func:`reserved_tokens`), and the caps leave room for them.

Both numbers are read once per endpoint: the context length from ``GET /v1/models``
(``max_model_len`` of the base model's card, the number the 400 compares with) and
``max_req_input_len`` from ``GET /server_info``. A server that does not say (a router, an older
SGLang) gets the request as before. A prompt that alone fills the context is refused, as vLLM refuses it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_service.bounded_http import request

log = logging.getLogger(__name__)

MAX_CONTEXT_TOKENS = 1 << 31
"""The largest context length taken from a server's answer (a larger one is not believed)."""


class PromptTooLong(ValueError):
    """A prompt the server cannot take at all (it alone fills the context or the longest input)."""


@dataclass(frozen=True)
class ContextLimits:
    """One server's length limits; None where it did not say."""

    context_len: int | None
    """Prompt + ``max_new_tokens`` may be at most this (``/v1/models`` ``max_model_len``)."""
    max_input_len: int | None
    """An input must be shorter than this (``/server_info`` ``max_req_input_len``)."""
    reserved: int = 0
    """Tokens SGLang counts on top of each input (speculative decoding's draft slots, see
    :func:`reserved_tokens`): prompt + reserved + ``max_new_tokens`` must fit the context."""

    def caps(self, prompt_lengths: list[int], max_new_tokens: int, *, rescoring: bool) -> list[int] | None:
        """Per prompt, the ``max_new_tokens`` to send it with; None when every prompt may have
        ``max_new_tokens`` as it is (the request is then sent unchanged). Raises
        :class:`PromptTooLong` for a prompt the server cannot take."""
        self.check_prompts(prompt_lengths)
        limit = None if self.context_len is None else self.context_len - self.reserved
        if limit is None and not (rescoring and self.max_input_len is not None):
            return None
        caps = []
        for n in prompt_lengths:
            cap = max_new_tokens if limit is None else min(max_new_tokens, limit - n)
            if rescoring and self.max_input_len is not None and self.max_input_len - 1 - n >= 1:
                cap = min(cap, self.max_input_len - 1 - n)  # prompt + completion rescored as an input
            caps.append(cap)  # at least 1: check_prompts refused a prompt that leaves none
        return caps if any(c < max_new_tokens for c in caps) else None

    def check_prompts(self, prompt_lengths: list[int]) -> None:
        """Raise :class:`PromptTooLong` naming the first prompt the server refuses whatever it is
        asked to generate: one that leaves no token of the context, or is no shorter than the
        longest input its scheduler takes (``max_req_input_len``)."""
        for i, n in enumerate(prompt_lengths):
            if self.context_len is not None and n + self.reserved >= self.context_len:
                raise PromptTooLong(
                    f"prompt {i} is {n} tokens long, and the server's context length is {self.context_len}"
                    + (f" (of which {self.reserved} are speculative decoding's)" if self.reserved else "")
                )
            if self.max_input_len is not None and n >= self.max_input_len:
                raise PromptTooLong(
                    f"prompt {i} is {n} tokens long, and the server takes inputs shorter than"
                    f" {self.max_input_len} tokens (its max_req_input_len)"
                )

    def rescorable(self, length: int) -> bool:
        """Whether prompt + completion of ``length`` tokens can be rescored (it is an input)."""
        return self.max_input_len is None or length < self.max_input_len


def read_context_limits(
    client: httpx.Client, url: str, *, headers: dict[str, str], timeout_s: float
) -> ContextLimits | None:
    """``url``'s limits; None when it could not be asked (no answer, or one other than 200 and
    404: ask again next time). A 404 means the server does not say (kept: no limit from it)."""
    answers: list[Any] = []
    for path in ("/v1/models", "/server_info"):
        try:
            answer = request(client, "GET", f"{url}{path}", headers=headers, timeout_s=timeout_s)
        except Exception as exc:  # best effort (a transport may raise anything): the request goes as it is
            log.debug("could not read SGLang's length limits at %s%s: %r", url, path, exc)
            return None
        if answer.status_code == 404:  # an SGLang (or router) without it: no limit from it, for good
            answers.append(None)
            continue
        try:
            if answer.status_code != 200:
                raise ValueError(f"HTTP {answer.status_code}")
            answers.append(answer.json())
        except ValueError as exc:  # a proxy's 502/503, a broken body: asked again next time
            log.debug("SGLang at %s answered %s with %s: its limits are asked again", url, path, exc)
            return None
    models, info = answers
    max_input = _positive(info.get("max_req_input_len")) if isinstance(info, dict) else None
    limits = ContextLimits(_base_model_len(models), max_input, reserved_tokens(info))
    log.debug("SGLang at %s: context length %s, longest input %s", url, limits.context_len, limits.max_input_len)
    return limits


def reserved_tokens(info: Any) -> int:
    """The tokens SGLang 0.5.23 adds to each input's count before comparing with the context
    length (``compute_num_reserved_tokens``): with EAGLE-style speculative decoding, the larger of
    ``speculative_eagle_topk x speculative_num_steps`` and the draft tokens; 0 without speculative
    decoding. Taken for any ``speculative_algorithm`` (a few tokens too many for the others)."""
    if not isinstance(info, dict) or not info.get("speculative_algorithm"):
        return 0
    topk, steps = _positive(info.get("speculative_eagle_topk")), _positive(info.get("speculative_num_steps"))
    drafts = [_positive(info.get(k)) for k in ("speculative_num_draft_tokens", "max_speculative_num_draft_tokens")]
    found = [topk * steps if topk and steps else None, *drafts]
    return min(max((n for n in found if n is not None), default=0), MAX_CONTEXT_TOKENS)


def _base_model_len(models: Any) -> int | None:
    """``max_model_len`` of the base model's card (the one without a ``parent``: LoRA adapters'
    cards have one) in a ``/v1/models`` answer."""
    cards = models.get("data") if isinstance(models, dict) else None
    if not isinstance(cards, list):
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("parent") is None:
            return _positive(card.get("max_model_len"))
    return None


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CONTEXT_TOKENS:
        return None
    return value
