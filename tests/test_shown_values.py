"""Untrusted values quoted in messages (SGLang's answers, ack files): bounded, and never failing.

``repr`` of a 5 MB string made a 5 MB exception message (broadcast to every trainer process and
logged at every retry), and ``repr``/``str`` of a list nested a few hundred deep raised
``RecursionError`` from deep inside a trainer. Real parser calls throughout; no server needed.
"""

from __future__ import annotations

import json
import sys

import pytest

from rollout_service.shown_values import shown, shown_text
from trainer_hooks.sglang_responses import SGLangResponseError, parse_generate_response


def _deep(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, "None"),
        (True, "True"),
        (7, "7"),
        (10**400, "an integer of 1329 bits"),
        (2.5, "2.5"),
        ("abc", "'abc'"),
        ("x" * 1000, "'" + "x" * 80 + "'... (1000 characters)"),
        ([1, "a", None], "[1, 'a', None]"),
        (list(range(9)), "a list of 9 values"),
        ({"a": 1}, "a JSON object of 1 keys"),
    ],
)
def test_a_value_is_shown_briefly(value, expected) -> None:
    assert shown(value) == expected


def test_showing_never_walks_into_a_value_however_deep_or_large() -> None:
    deep = _deep(sys.getrecursionlimit() * 2)
    assert shown(deep) == "a list of 1 values" and shown_text(deep) == "a list of 1 values"
    assert len(shown("y" * 10_000_000)) < 120 and shown_text("z" * 10_000, 40) == "z" * 40 + "..."


@pytest.mark.parametrize(
    "item",
    [
        {"meta_info": {}, "output_ids": ["A" * 5_000_000]},
        {"meta_info": {"prompt_tokens": "A" * 5_000_000}, "output_ids": [1]},
        {"meta_info": {"prompt_tokens": _deep(500)}, "output_ids": [1]},
        {"meta_info": {"weight_version": "3", "output_token_logprobs": ["A" * 5_000_000]}, "output_ids": [1]},
    ],
    ids=["token-id", "prompt-tokens", "prompt-tokens-deep", "logprob-entry"],
)
def test_an_answer_refused_for_a_huge_or_deep_value_is_refused_in_a_short_message(item) -> None:
    with pytest.raises(SGLangResponseError) as refused:
        parse_generate_response([item], num_prompts=1, n=1, want_logprobs=True, prompt_lengths=[2])
    assert len(str(refused.value)) < 400, len(str(refused.value))


def test_a_weight_version_of_any_shape_is_kept_bounded_for_the_staleness_messages() -> None:
    for version, raw in (
        ("A" * 1_000_000, "'" + "A" * 64 + "'... (1000000 characters)"),
        (_deep(50), "a list of 1 values"),
    ):
        item = {"meta_info": {"weight_version": version}, "output_ids": [1]}
        [[completion]] = parse_generate_response(
            json.loads(json.dumps([item])), num_prompts=1, n=1, want_logprobs=False
        )
        assert completion.weight_version is None and completion.raw_weight_version == raw
