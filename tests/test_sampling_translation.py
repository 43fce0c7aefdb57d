"""TRL's sampling settings as SGLang gets them, and completions scattered back to the processes.

- Processes may pass different numbers of prompts to ``generate()`` (TRL's tool loop sends only
  the samples that called a tool): each gets the completions of its own prompts, and an answer that
  does not match the prompts raises the same error on every process (none is left in a collective).
- ``seed`` / ``sampling_seed`` are refused: SGLang 0.5.23's seed makes the n samples of a prompt
  identical (with ``--enable-deterministic-inference``) or does nothing (without).
- ``repetition_penalty != 1`` is passed with a warning: SGLang penalises generated tokens only.
- The SGLang sampling parameters are built once (TRL's fields, ``generation_kwargs``, then
  ``vllm_structured_outputs_regex`` with TRL's precedence), and the config's checks (values, one
  grammar, the collective budget) see exactly what ``SGLangGeneration`` sends.
- ``do_sample=False`` is greedy even with a ``top_k``; greedy logprobs (untempered in SGLang) are
  not used for the IS correction when ``temperature != 1``.

No SGLang server: collectives are simulated with threads, SGLang's answers with a fake.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import trainer_hooks.sglang_generation as sg
from trainer_helpers import make_config
from trainer_hooks import GRPOConfig, RLOOConfig
from trainer_hooks.config import adapt_trl_fields, collective_budget_s, translate_generation_kwargs
from trainer_hooks.sglang_generation import SGLangGeneration
from trainer_hooks.sglang_responses import Completion
from trainer_hooks.stale_retry import GenerationRecord

DEAD = ["http://127.0.0.1:9"]


def _config(tmp_path: Path, config_class: type = GRPOConfig, **overrides: Any) -> Any:
    return make_config(tmp_path, tmp_path, DEAD, DEAD, config_class=config_class, **overrides)


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


class _NotMain:
    is_main_process = False
    num_processes = 1
    process_index = 0


# --- several processes: each gets the completions of its own prompts ---------------------------------


class _Accelerator:
    def __init__(self, index: int, size: int) -> None:
        self.process_index, self.num_processes, self.is_main_process = index, size, index == 0


class _World:
    """``size`` simulated processes (threads) with accelerate's two collectives as barrier exchanges.

    A process that stops calling collectives while the others still do leaves them at a barrier
    that times out (``BrokenBarrierError``): what would be a hang in a real process group.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[Any] = [None] * size
        self.local = threading.local()

    def gather_object(self, obj: list[Any]) -> list[Any]:
        self.slots[self.local.rank] = copy.deepcopy(list(obj))
        self.barrier.wait()
        out = [x for slot in self.slots for x in slot]
        self.barrier.wait()
        return out

    def broadcast_object_list(self, box: list[Any], from_process: int = 0) -> list[Any]:
        if self.local.rank == from_process:
            self.slots[from_process] = copy.deepcopy(list(box))
        self.barrier.wait()
        box[:] = copy.deepcopy(self.slots[from_process])
        self.barrier.wait()
        return box

    def run(self, body: Callable[[int], Any]) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any]] = [("missing", None)] * self.size

        def process(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = ("returned", body(rank))
            except BaseException as exc:  # what each process ends with
                results[rank] = ("raised", exc)

        threads = [threading.Thread(target=process, args=(rank,)) for rank in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results


class _Rollouts:
    """Answers each unique prompt ``p`` with ``n`` completions ``[p[0] + 1000, k]``; ``drop`` groups fewer."""

    endpoints = None

    def __init__(self, drop: int = 0) -> None:
        self.drop = drop
        self.sent: list[list[list[int]]] = []

    def generate(
        self, unique: list[list[int]], params: dict[str, Any], *, want_logprobs: bool, rescore: bool
    ) -> tuple[list[list[Completion]], GenerationRecord]:
        self.sent.append(unique)
        groups = [
            [Completion([p[0] + 1000, k], [-0.5, -0.25], 1, "1") for k in range(params["n"])]
            for p in unique[: len(unique) - self.drop]
        ]
        return groups, GenerationRecord(1, 1, [1] * len(unique), 0, 0.0)


def _generate_in(
    monkeypatch: pytest.MonkeyPatch,
    per_process: list[list[list[int]]],
    num_generations: int,
    rollouts: _Rollouts,
) -> list[tuple[str, Any]]:
    world = _World(len(per_process))
    monkeypatch.setattr(sg, "gather_object", world.gather_object)
    monkeypatch.setattr(sg, "broadcast_object_list", world.broadcast_object_list)
    size = len(per_process)
    gens = [
        SGLangGeneration(None, _Accelerator(0, size), None, publisher=object(), rollouts=rollouts),  # type: ignore[arg-type]
        *(SGLangGeneration(None, _Accelerator(i, size), None) for i in range(1, size)),
    ]
    return world.run(lambda rank: gens[rank].generate(per_process[rank], None, num_generations))


@pytest.mark.parametrize(
    ("per_process", "num_generations"),
    [
        ([[[1]], [[2], [3]]], 1),  # TRL's tool loop: only the samples that called a tool, per process
        ([[[1], [2]], [], [[3]]], 1),  # a process with none left (it still calls generate)
        ([[[1], [1], [2], [2]], [[3], [3]]], 2),
        ([[[1]], [[1], [2], [2]]], 2),  # a prompt group split across processes
    ],
)
def test_processes_with_different_prompt_counts_get_their_own_completions(
    monkeypatch: pytest.MonkeyPatch, per_process: list[list[list[int]]], num_generations: int
) -> None:
    rollouts = _Rollouts()
    results = _generate_in(monkeypatch, per_process, num_generations, rollouts)
    assert rollouts.sent == [[p for sent in per_process for p in sent][::num_generations]]
    for rank, (how, result) in enumerate(results):
        assert how == "returned", (rank, result)
        prompts, completions, logprobs, token_ids = result
        assert prompts == per_process[rank]
        # Each completion answers this process's own prompt (its first token is prompt + 1000).
        assert [c[0] for c in completions] == [p[0] + 1000 for p in per_process[rank]], (rank, completions)
        assert logprobs == [[[-0.5], [-0.25]]] * len(prompts)
        assert token_ids == [[[t] for t in c] for c in completions]


def test_answers_that_do_not_match_the_prompts_raise_the_same_error_on_every_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = _generate_in(monkeypatch, [[[1]], [[2], [3]]], 1, _Rollouts(drop=1))
    assert [how for how, _ in results] == ["raised", "raised"], results
    errors = [exc for _, exc in results]
    assert all(isinstance(e, RuntimeError) for e in errors), errors  # not BrokenBarrierError: nobody hung
    assert "2 completions back for 3 prompts (per process: [1, 2]" in str(errors[0])
    assert str(errors[0]) in str(errors[1])  # the main process's error, re-raised on the other


# --- seed ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["seed", "sampling_seed"])
def test_a_seed_is_refused_saying_why(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match=rf"generation_kwargs {key}=3: .*--enable-deterministic-inference.*identical"):
        translate_generation_kwargs({key: 3})
    with pytest.raises(ValueError, match=r"Drop it from generation_kwargs"):
        _config(tmp_path, generation_kwargs={key: 3})
    with pytest.raises(ValueError, match=r"every GRPO advantage is zero"):
        _config(tmp_path, config_class=RLOOConfig, generation_kwargs={key: 3})


# --- repetition_penalty: generated tokens only -----------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{"repetition_penalty": 1.2}, {"generation_kwargs": {"repetition_penalty": 1.2}}],
    ids=["field", "generation_kwargs"],
)
def test_repetition_penalty_is_passed_with_a_warning_that_sglang_skips_the_prompt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, overrides: dict[str, Any]
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(tmp_path, **overrides)
    [line] = [m for m in _messages(caplog).splitlines() if m.startswith("repetition_penalty=1.2")]
    assert "only the tokens generated" in line and "not the prompt's tokens" in line
    gen = SGLangGeneration(
        None,
        _NotMain(),
        None,
        repetition_penalty=config.repetition_penalty,
        generation_kwargs=config.generation_kwargs,
    )
    assert gen.sampling_params["repetition_penalty"] == 1.2
    caplog.clear()
    _config(tmp_path)
    assert "repetition_penalty" not in _messages(caplog)


# --- one effective sampling dict for the checks and for SGLang -----------------------------------------


def _generation_from(config: Any) -> SGLangGeneration:
    """What TRL builds from ``config``: its VLLMGeneration arguments through trainer_hooks' factory."""
    from trainer_hooks.trainer import _sglang_factory

    return _sglang_factory(config, lambda: 0)(
        model=None,
        accelerator=_NotMain(),
        processing_class=None,
        structured_outputs_regex=config.vllm_structured_outputs_regex,
        repetition_penalty=config.repetition_penalty,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        max_completion_length=config.max_completion_length,
        logprobs=0,
        generation_kwargs=config.generation_kwargs,
    )


@pytest.mark.parametrize(
    "generation_kwargs",
    [{"json_schema": '{"type": "string"}'}, {"regex": "[a-z]+"}, {"ebnf": 'root ::= "a"'}],
    ids=["json_schema", "regex", "ebnf"],
)
def test_trls_regex_takes_precedence_over_a_grammar_in_generation_kwargs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, generation_kwargs: dict[str, Any]
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(tmp_path, vllm_structured_outputs_regex="[0-9]+", generation_kwargs=generation_kwargs)
    [key] = generation_kwargs
    assert f"vllm_structured_outputs_regex takes precedence over generation_kwargs {key}" in _messages(caplog)
    params = _generation_from(config).sampling_params
    # One grammar reaches SGLang (two would be HTTP 400 at the first step), and it is TRL's.
    assert params["regex"] == "[0-9]+"
    assert not {"json_schema", "ebnf", "structural_tag"} & set(params)


def test_the_config_checks_exactly_what_sglang_generation_sends(tmp_path: Path) -> None:
    from trainer_hooks.config import config_sampling_params

    config = _config(
        tmp_path,
        temperature=0.9,
        top_k=20,
        min_p=None,
        repetition_penalty=1.1,
        max_completion_length=12,
        vllm_structured_outputs_regex="[0-9]+",
        generation_kwargs={"max_tokens": 6, "stop_strings": ["\n"], "top_p": 0.9, "repetition_penalty": 1.0},
    )
    assert (
        _generation_from(config).sampling_params
        == config_sampling_params(config)
        == {
            "temperature": 0.9,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.0,
            "repetition_penalty": 1.0,  # generation_kwargs override TRL's fields, as in TRL
            "max_new_tokens": 6,
            "stop": ["\n"],
            "regex": "[0-9]+",
        }
    )


@pytest.mark.parametrize(
    ("overrides", "rescoring"),
    [
        ({"vllm_structured_outputs_regex": "[0-9]+"}, True),
        ({"generation_kwargs": {"regex": "[0-9]+"}}, True),
        ({"generation_kwargs": {"repetition_penalty": 1.2}}, True),
        ({"repetition_penalty": 1.2}, True),
        # generation_kwargs override TRL's field: no penalty reaches SGLang, nothing is rescored.
        ({"repetition_penalty": 1.2, "generation_kwargs": {"repetition_penalty": 1.0}}, False),
        ({}, False),
    ],
)
def test_the_collective_budget_counts_the_rescoring_sglang_will_do(
    tmp_path: Path, overrides: dict[str, Any], rescoring: bool
) -> None:
    config = _config(tmp_path, use_cpu=False, **overrides)
    adapt_trl_fields(config, world_size=2)
    assert config.ddp_timeout == int(collective_budget_s(config.sync_timeout, 1800.0, rescoring=rescoring))
    assert (_generation_from(config).logprob_source == "rescored") == rescoring


# --- TRL's own sampling fields are checked when the config is made ---------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"repetition_penalty": 2.5}, r"^repetition_penalty must be a number in \(0, 2\], got 2.5"),
        ({"repetition_penalty": 0.0}, r"^repetition_penalty must be a number in \(0, 2\]"),
        ({"top_p": 0.0}, r"^top_p must be a number in \(0, 1\], got 0.0"),
        ({"top_k": -2}, r"^top_k must be -1 \(no limit\) or a whole number >= 1, got -2"),
        ({"min_p": 1.5}, r"^min_p must be a number in \[0, 1\], got 1.5"),
        ({"temperature": -0.5}, r"^temperature=-0\.5: TRL divides .* keep it > 0"),
        (
            {"max_completion_length": 4, "generation_kwargs": {"min_new_tokens": 6}},
            r"min_new_tokens=6 is above max_completion_length=4: lower min_new_tokens or raise max_completion_length",
        ),
    ],
)
def test_trl_sampling_fields_sglang_would_refuse_are_refused_naming_the_field(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_trl_sampling_fields_are_accepted_exactly_when_sglang_accepts_them() -> None:
    from sglang.srt.sampling.sampling_params import SamplingParams

    from trainer_hooks.config import TRL_SAMPLING_FIELDS, sglang_sampling_params

    grid: dict[str, list[Any]] = {
        "temperature": [-1.0, 0.0, 0.7, 2.5, float("inf")],
        "top_p": [-0.1, 0.0, 0.5, 1.0, 1.5],
        "top_k": [-2, -1, 0, None, 1, 40],
        "min_p": [-0.1, None, 0.0, 0.3, 1.0, 1.1],
        "repetition_penalty": [-1.0, 0.0, 0.5, 2.0, 2.5],
        "max_completion_length": [-5, 0, 16, None],
    }
    sglang_name = {field: key for key, field in TRL_SAMPLING_FIELDS.items()}
    translated = {"top_k": {0: -1, None: -1}, "min_p": {None: 0.0}}  # TRL's "disabled" values
    for field, values in grid.items():
        for value in values:
            sent = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_new_tokens=16)
            sent[sglang_name[field]] = translated.get(field, {}).get(value, value)
            try:
                SamplingParams(**sent).verify(vocab_size=1000)
                sglang_accepts = True
            except ValueError:
                sglang_accepts = False
            try:
                assert sglang_sampling_params(**{field: value}) == sent
                accepted = True
            except ValueError as exc:
                assert str(exc).startswith(field), exc
                accepted = False
            stricter = (field, value) == ("max_completion_length", 0)  # TRL cannot train on no token
            assert accepted == (sglang_accepts and not stricter), (field, value)


# --- do_sample=False and greedy logprobs -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"do_sample": False, "top_k": 50}, {"top_k": 50, "do_sample": False}, {"do_sample": False}],
    ids=["do_sample-first", "top_k-first", "alone"],
)
def test_do_sample_false_is_greedy_even_with_a_top_k(kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    assert translate_generation_kwargs(dict(kwargs)) == {"top_k": 1}
    if "top_k" in kwargs:
        assert "do_sample=False overrides top_k=50" in _messages(caplog)


def test_do_sample_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"generation_kwargs do_sample must be true or false, got 'false'"):
        translate_generation_kwargs({"do_sample": "false"})


@pytest.mark.parametrize(
    ("kwargs", "temperature", "source"),
    [
        ({"do_sample": False}, 0.7, "none"),  # SGLang's greedy logprobs are untempered, the trainer's are not
        ({"top_k": 1}, 1.3, "none"),
        ({"temperature": 0.0}, 0.7, "none"),  # SGLang turns temperature 0 into top_k=1
        ({"top_k": 1, "regex": "[a-z]+"}, 0.7, "none"),
        ({"do_sample": False}, 1.0, "sampled"),  # at temperature 1 both are the model's own log-softmax
        ({"top_k": 1, "regex": "[a-z]+"}, 1.0, "rescored"),
        ({"top_k": 2}, 0.7, "sampled"),
    ],
)
def test_greedy_logprobs_are_not_used_as_temperature_scaled_ones(
    kwargs: dict[str, Any], temperature: float, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    gen = SGLangGeneration(
        None, _NotMain(), None, temperature=temperature, generation_kwargs=translate_generation_kwargs(kwargs)
    )
    assert gen.logprob_source == source
    if source == "none":
        assert "Use temperature=1.0 to keep it" in _messages(caplog)
