"""Completions are rescored only when TRL reads the engine's logprobs, and sampling keys that TRL
accepts reach SGLang in its spelling (a review of TRL's options, session 31).

TRL's GRPO always asks the engine for the sampled tokens' logprobs (``logprobs=0``) but reads them
only for its importance-sampling correction (``vllm_importance_sampling_correction``) or its
off-policy sequence mask (``off_policy_mask_threshold``). With both off, a distribution-changing
setting (``repetition_penalty`` here) made every batch pay a second, prefill-only rescore request,
doubled the process group's timeout budget and warned about a rescore for nothing. The training
run uses the fake SGLang (``fake_sglang.FakeRollout``), which answers no rescore: a run that
trains there sent none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_sglang import FakeRollout
from trainer_helpers import make_config, make_trainer
from trainer_hooks import GRPOConfig, RLOOConfig
from trainer_hooks.config import (
    adapt_trl_fields,
    completions_rescored,
    engine_logprobs_used,
    translate_generation_kwargs,
)
from trainer_hooks.sglang_generation import SGLangGeneration


def _config(tmp_path: Path, config_class: type = GRPOConfig, **overrides):
    url = "http://127.0.0.1:1"  # nothing is contacted: the config alone
    (tmp_path / "ckpts").mkdir(exist_ok=True)
    return make_config(tmp_path, tmp_path / "ckpts", [url], [url], config_class=config_class, **overrides)


def test_which_configs_read_the_engines_logprobs(tmp_path: Path) -> None:
    assert engine_logprobs_used(_config(tmp_path))  # GRPO's correction is on by default
    off = _config(tmp_path, vllm_importance_sampling_correction=False)
    assert not engine_logprobs_used(off)
    assert engine_logprobs_used(
        _config(tmp_path, vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.5)
    )
    assert not engine_logprobs_used(_config(tmp_path, RLOOConfig))
    penalised = {"repetition_penalty": 1.1}
    assert completions_rescored(_config(tmp_path), penalised)
    assert not completions_rescored(off, penalised)
    assert not completions_rescored(_config(tmp_path), {})


def test_the_process_groups_budget_counts_a_rescore_only_where_one_is_sent(tmp_path: Path) -> None:
    def ddp_timeout(config_class: type = GRPOConfig, **overrides) -> float:
        config = _config(tmp_path, config_class, use_cpu=False, **overrides)
        config.ddp_timeout = 1800
        adapt_trl_fields(config, world_size=2)
        return config.ddp_timeout

    plain = ddp_timeout()
    assert ddp_timeout(repetition_penalty=1.1) > plain  # rescored: two requests a round
    assert ddp_timeout(repetition_penalty=1.1, vllm_importance_sampling_correction=False) == plain
    assert ddp_timeout(RLOOConfig, repetition_penalty=1.1) == plain


def test_the_penalty_warning_speaks_of_a_rescore_only_when_there_is_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_hooks.config"):
        _config(tmp_path, repetition_penalty=1.1, vllm_importance_sampling_correction=False)
    penalty = [r.getMessage() for r in caplog.records if "repetition_penalty=1.1" in r.getMessage()]
    assert penalty and "rescored" not in penalty[0], penalty
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_hooks.config"):
        _config(tmp_path, repetition_penalty=1.1)
    assert any("rescored" in r.getMessage() for r in caplog.records if "repetition_penalty" in r.getMessage())


def test_the_backend_keeps_sglangs_own_logprobs_when_nothing_reads_them() -> None:
    other = SimpleNamespace(is_main_process=False, process_index=1, num_processes=2)
    kept = SGLangGeneration(None, other, None, repetition_penalty=1.1, logprobs=0, logprobs_used=False)
    assert kept.logprob_source == "sampled" and kept.want_logprobs  # TRL still gets a logprob per token
    read = SGLangGeneration(None, other, None, repetition_penalty=1.1, logprobs=0)
    assert read.logprob_source == "rescored"


def test_grpo_with_the_correction_off_sends_no_rescore(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    config = make_config(
        tmp_path,
        root,
        [fake.url],
        [fake.url],
        max_steps=1,
        repetition_penalty=1.1,
        vllm_importance_sampling_correction=False,
    )
    trainer = make_trainer(tiny_model_dir, config)
    trainer.train()  # the fake cannot rescore: a rescore request would fail the step
    assert fake.generate_requests
    assert all(
        request["sampling_params"]["max_new_tokens"] > 0 and "logprob_start_len" not in request
        for request in fake.generate_requests
    ), fake.generate_requests[:2]
    assert trainer.vllm_generation.logprob_source == "sampled"


def test_top_k_zero_in_generation_kwargs_means_no_limit_as_the_field_does() -> None:
    assert translate_generation_kwargs({"top_k": 0}) == {"top_k": -1}
    assert translate_generation_kwargs({"top_k": 5}) == {"top_k": 5}
    with pytest.raises(ValueError, match="top_k"):
        translate_generation_kwargs({"top_k": -2})
    with pytest.raises(ValueError, match="top_k"):
        translate_generation_kwargs({"top_k": False})  # not a number, even though False == 0


def test_eos_token_id_is_said_to_add_stop_ids_not_replace_the_models(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_hooks.config"):
        assert translate_generation_kwargs({"eos_token_id": 7}) == {"stop_token_ids": [7]}
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "still at the model's" in message and "not replaced" in message, message
