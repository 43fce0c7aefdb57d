"""``generation_kwargs`` values SGLang would refuse are refused when the config is made, naming
the key; before, ``eos_token_id=None`` crashed in ``int()``, ``eos_token_id=2.7`` became stop token
2, ``min_new_tokens="5"`` crashed the trainer's rescoring check, and out-of-range numbers came
back as HTTP 400 at the first generation step.

The numeric rules are checked against SGLang's own ``SamplingParams.verify`` (the installed
0.5.23): for each value on a grid, the config accepts it exactly when SGLang does.
"""

from __future__ import annotations

from typing import Any

import pytest

from trainer_hooks.config import translate_generation_kwargs

GRID: dict[str, list[Any]] = {
    "temperature": [-1.0, 0.0, 0.7, 2.5, float("inf"), float("nan")],
    "top_p": [-0.1, 0.0, 0.5, 1.0, 1.5],
    "min_p": [-0.1, 0.0, 0.3, 1.0, 1.1],
    "top_k": [-2, -1, 0, 1, 40],
    "frequency_penalty": [-2.5, -2.0, 0.0, 2.0, 2.1],
    "presence_penalty": [-2.1, -2.0, 1.0, 2.0, 3.0],
    "repetition_penalty": [-1.0, 0.0, 0.5, 2.0, 2.5],
    "max_new_tokens": [-5, 0, 16],
    "min_new_tokens": [-1, 0, 4],
}


def sglang_accepts(key: str, value: Any) -> bool:
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = {key: value}
    if key == "min_new_tokens":
        params["max_new_tokens"] = 16
    try:
        SamplingParams(**params).verify(vocab_size=1000)
    except ValueError:
        return False
    return True


def config_accepts(key: str, value: Any) -> bool:
    params = {key: value}
    if key == "min_new_tokens":
        params["max_new_tokens"] = 16
    try:
        translate_generation_kwargs(params)
    except ValueError as exc:
        assert key in str(exc), exc
        return False
    return True


@pytest.mark.parametrize("key", sorted(GRID))
def test_the_config_accepts_exactly_the_numbers_sglang_accepts(key: str) -> None:
    for value in GRID[key]:
        expected = sglang_accepts(key, value) and (key, value) not in STRICTER_THAN_SGLANG
        expected = expected or (key, value) in TRANSLATED_FOR_SGLANG
        assert config_accepts(key, value) == expected, (key, value)


STRICTER_THAN_SGLANG = {("max_new_tokens", 0)}
"""Values SGLang takes that the config refuses: no completion token at all (TRL reads each
completion's last token; vLLM refuses ``max_tokens=0`` too)."""

TRANSLATED_FOR_SGLANG = {("top_k", 0)}
"""Values SGLang refuses that the config takes and sends in SGLang's spelling: ``top_k=0`` is
"no limit" to transformers, vLLM and TRL's own ``top_k`` field, SGLang's -1."""


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eos_token_id": None}, r"eos_token_id \(SGLang's stop_token_ids\) must be a list of token ids"),
        (
            {"eos_token_id": 2.7},
            r"eos_token_id \(SGLang's stop_token_ids\) must be a list of token ids .*, got \[2.7\]",
        ),
        ({"eos_token_id": "eos"}, r"eos_token_id \(SGLang's stop_token_ids\) must be a list"),
        ({"stop_token_ids": [1.5, "x"]}, r"stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [True]}, r"stop_token_ids must be a list of token ids"),
        ({"min_new_tokens": "5"}, r"min_new_tokens must be a whole number >= 0, got '5'"),
        ({"max_new_tokens": 2.5}, r"max_new_tokens must be a whole number >= 1"),
        ({"max_tokens": -5}, r"max_tokens \(SGLang's max_new_tokens\) must be a whole number >= 1"),
        ({"temperature": "hot"}, r"temperature must be a finite number >= 0, got 'hot'"),
        ({"stop": ["a", 3]}, r"stop must be a string or a list of strings"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be true or false"),
        ({"seed": 3}, r"generation_kwargs seed=3: SGLang 0.5.23 has no per-request seed"),
        ({"min_new_tokens": 8, "max_new_tokens": 4}, r"min_new_tokens=8 is above max_new_tokens=4"),
    ],
)
def test_a_value_sglang_would_refuse_is_refused_naming_the_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        translate_generation_kwargs(kwargs)


def test_values_sglang_takes_pass_through() -> None:
    assert translate_generation_kwargs({"eos_token_id": [2, 7], "stop": "\n", "max_tokens": None, "top_k": -1}) == {
        "stop_token_ids": [2, 7],
        "stop": "\n",
        "max_new_tokens": None,
        "top_k": -1,
    }
    assert translate_generation_kwargs({"eos_token_id": 3}) == {"stop_token_ids": [3]}
