"""How the trainer asks SGLang for rollouts, at its edges (a review against TRL's vLLM path):

- an error while the main process built the backend (a float64 model, a bad setting only the
  main process sees) left the other processes in the next collective until the process group's
  watchdog (75 min by default), their logs silent about why;
- an empty completion (``max_completion_length=0``, or a server answering no token) passed
  every check and crashed inside TRL with a bare ``IndexError`` (TRL reads each completion's
  last token; vLLM refuses ``max_tokens=0``);
- ``generation_kwargs`` set on the config after it was built skipped the translation into
  SGLang's names and its refusals (``max_tokens`` reached SGLang as is, ``seed`` passed).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import trainer_hooks.trainer as trainer_module
from fake_sglang import dead_url
from rollout_service.tiny_model import ensure_tiny_model
from test_sampling_translation import _Accelerator, _World
from trainer_helpers import make_config
from trainer_hooks.sglang_responses import SGLangResponseError, parse_generate_response


def test_an_error_building_the_backend_on_the_main_process_is_raised_on_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(tmp_path, tmp_path, [dead_url()], [dead_url()], sync_timeout=5)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tied=False), dtype=torch.float64)
    world = _World(2)
    world.barrier = threading.Barrier(2, timeout=20)  # stands for the process group's watchdog
    monkeypatch.setattr(trainer_module, "broadcast_object_list", world.broadcast_object_list)
    monkeypatch.setattr("trainer_hooks.sglang_generation.broadcast_object_list", world.broadcast_object_list)
    started = time.monotonic()
    results = world.run(
        lambda rank: trainer_module.build_sglang_generation(model, _Accelerator(rank, 2), None, args=config)
    )
    assert time.monotonic() - started < 15, "a process waited for the watchdog"
    (how_main, main_error), (how_other, other_error) = results
    assert how_main == how_other == "raised", results
    assert isinstance(main_error, ValueError) and "float64" in str(main_error)
    assert isinstance(other_error, RuntimeError), other_error  # not BrokenBarrierError: a hang
    assert "building the SGLang backend failed on the main process" in str(other_error)
    assert "float64" in str(other_error)


def _answer(output_ids: list[int], finish: str) -> list[dict]:
    logprobs = [[-0.5, t, None] for t in output_ids]
    meta = {"output_token_logprobs": logprobs, "weight_version": "1", "finish_reason": {"type": finish}}
    return [{"output_ids": output_ids, "meta_info": meta}]


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_an_empty_completion_is_refused_naming_the_server(finish: str) -> None:
    with pytest.raises(SGLangResponseError, match="no output ids"):
        parse_generate_response(_answer([], finish), num_prompts=1, n=1, want_logprobs=True)
    groups = parse_generate_response(_answer([7], finish), num_prompts=1, n=1, want_logprobs=True)
    assert groups[0][0].token_ids == [7]


def test_an_empty_aborted_completion_is_still_taken_to_be_generated_again() -> None:
    groups = parse_generate_response(_answer([], "abort"), num_prompts=1, n=1, want_logprobs=False)
    assert groups[0][0].finish_reason == "abort" and groups[0][0].token_ids == []


@pytest.mark.parametrize("overrides", [{"max_completion_length": 0}, {"generation_kwargs": {"max_new_tokens": 0}}])
def test_no_completion_tokens_at_all_is_refused_by_the_config(tmp_path: Path, overrides: dict) -> None:
    with pytest.raises(ValueError, match="whole number >= 1"):
        make_config(tmp_path, tmp_path, [dead_url()], [dead_url()], **overrides)


class _NotMain:
    is_main_process, num_processes, process_index = False, 1, 0


def test_generation_kwargs_set_after_the_config_was_built_are_translated_and_checked(tmp_path: Path) -> None:
    config = make_config(tmp_path, tmp_path, [dead_url()], [dead_url()])
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tied=False))
    late = {"max_tokens": 5, "do_sample": False}
    generation = trainer_module.build_sglang_generation(model, _NotMain(), None, args=config, generation_kwargs=late)
    params = generation.sampling_params
    assert params["max_new_tokens"] == 5 and "max_tokens" not in params and "do_sample" not in params, params
    assert params["top_k"] == 1  # do_sample=False: greedy
    with pytest.raises(ValueError, match="seed"):
        trainer_module.build_sglang_generation(model, _NotMain(), None, args=config, generation_kwargs={"seed": 3})


def test_a_sampling_temperature_other_than_the_scoring_one_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="trainer_hooks.config"):
        make_config(tmp_path, tmp_path, [dead_url()], [dead_url()], generation_kwargs={"temperature": 0.7})
    assert "TRL scores the completions" in caplog.text and "temperature=0.7" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer_hooks.config"):
        make_config(
            tmp_path, tmp_path, [dead_url()], [dead_url()], temperature=0.7, generation_kwargs={"temperature": 0.7}
        )
    assert "TRL scores the completions" not in caplog.text


def test_a_temperature_trl_cannot_score_at_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TRL 1.16 divides the logits by ``temperature`` at the first loss: 0 passed the config's
    checks (SGLang takes it: greedy) and crashed there; the warning even advised it."""
    with pytest.raises(ValueError, match=r"temperature=0\.0: TRL divides .* keep it > 0"):
        make_config(tmp_path, tmp_path, [dead_url()], [dead_url()], temperature=0.0)
    with caplog.at_level("WARNING", logger="trainer_hooks.config"):
        make_config(tmp_path, tmp_path, [dead_url()], [dead_url()], generation_kwargs={"temperature": 0.0})
    assert "TRL scores the completions" in caplog.text and "Set temperature=0 instead" not in caplog.text


def test_a_model_made_from_its_config_publishes_its_architecture(tmp_path: Path) -> None:
    """``from_config`` leaves ``architectures`` unset until the model is saved: the published
    config.json had none, and a materialized version was a model directory SGLang refuses."""
    from transformers import AutoConfig

    config = make_config(tmp_path, tmp_path, [dead_url()], [dead_url()])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ensure_tiny_model(tied=False)))
    model.config.architectures = None
    generation = trainer_module.build_sglang_generation(model, _Accelerator(0, 1), None, args=config)
    try:
        assert generation.publisher is not None
        assert generation.publisher.config["architectures"] == ["Qwen2ForCausalLM"]
    finally:
        generation.close()
