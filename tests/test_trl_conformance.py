"""TRL 1.16 config fields with SGLang rollouts: each works, is adapted with one log line, or is refused
when the config is built with the fix named (docs/trl-conformance.md has the table).

The generation-changing fields are checked through real TRL GRPOTrainer runs on a real SGLang.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_unit import ready_unit
from trainer_helpers import logged, make_config, make_trainer
from trainer_hooks import GRPOConfig, RLOOConfig
from trainer_hooks.config import adapt_trl_fields, collective_budget_s, translate_generation_kwargs

DEAD = ["http://127.0.0.1:9"]


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def _config(tmp_path: Path, config_class: type = GRPOConfig, **overrides: Any) -> Any:
    return make_config(tmp_path, tmp_path, DEAD, DEAD, config_class=config_class, **overrides)


# --- generation_kwargs: SGLang's names --------------------------------------------------------------


def test_transformers_generation_kwargs_are_renamed_or_dropped_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(
        tmp_path,
        generation_kwargs={
            "do_sample": False,
            "num_beams": 1,
            "eos_token_id": 7,
            "max_tokens": 5,
            "use_cache": True,
            "min_p": 0.05,
            "stop": ["\n"],
        },
    )
    assert config.generation_kwargs == {
        "top_k": 1,
        "stop_token_ids": [7],
        "max_new_tokens": 5,
        "min_p": 0.05,
        "stop": ["\n"],
    }
    text = _messages(caplog)
    assert "do_sample=False -> top_k=1" in text and "eos_token_id=7 sent as SGLang's stop_token_ids" in text
    assert "use_cache dropped" in text and "num_beams=1 dropped" in text


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_beams": 4}, r"num_beams=4: beam search .*drop num_beams and sample num_generations"),
        ({"length_penalty": 1.2}, r"length_penalty=1.2 has no SGLang counterpart .*only applies to beam search"),
        ({"max_length": 64}, r"max_length=64 .*use max_completion_length"),
        ({"no_repeat_ngram_size": 3}, r"no_repeat_ngram_size=3 .*repetition_penalty / frequency_penalty"),
        ({"num_return_sequences": 4}, r"num_return_sequences=4 .*use num_generations"),
        ({"n": 4}, r"n=4 .*use num_generations"),
        ({"typical_p": 0.9}, r"typical_p=0.9 .*top_p / min_p"),
        ({"bad_words_ids": [[5]]}, r"bad_words_ids=\[\[5\]\] .*logit_bias"),
        (
            {"temprature": 0.7},
            r"temprature=0.7 is not an SGLang sampling parameter .*Use SGLang's names: .*temperature",
        ),
        ({"regex": "a+", "json_schema": "{}"}, r"several SGLang constraints \['regex', 'json_schema'\]"),
    ],
)
def test_generation_kwargs_without_an_sglang_counterpart_are_refused_naming_the_fix(
    tmp_path: Path, kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        _config(tmp_path, generation_kwargs=kwargs)
    with pytest.raises(ValueError, match=named):
        _config(tmp_path, config_class=RLOOConfig, generation_kwargs=kwargs)


def test_sglang_names_pass_unchanged() -> None:
    kwargs = {
        "regex": "( [a-z]+)+",
        "min_new_tokens": 2,
        "stop_token_ids": [3],
        "frequency_penalty": 0.1,
        "logit_bias": {"5": -100.0},
        "ignore_eos": True,
        "skip_special_tokens": False,
    }
    assert translate_generation_kwargs(dict(kwargs)) == kwargs


# --- loss and engine fields -------------------------------------------------------------------------


def test_vespo_gets_a_token_level_is_mode_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(tmp_path, loss_type="vespo")
    assert config.vllm_importance_sampling_mode == "token_truncate"
    assert [r for r in caplog.records if "loss_type='vespo'" in r.getMessage()], caplog.text
    # A token-level mode the user chose stays.
    assert (
        _config(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="token_mask").vllm_importance_sampling_mode
        == "token_mask"
    )


def test_transformers_generation_switches_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"use_transformers_continuous_batching=True asks TRL to generate in the "
        r"trainer.*drop use_transformers_continuous_batching",
    ):
        _config(tmp_path, use_transformers_continuous_batching=True)


def test_vllm_engine_settings_are_ignored_with_the_sglang_flag_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    _config(
        tmp_path,
        vllm_gpu_memory_utilization=0.8,
        vllm_tensor_parallel_size=2,
        vllm_server_port=8001,
        cache_implementation="static",
    )
    text = _messages(caplog)
    assert (
        "vllm_gpu_memory_utilization=0.8 is not used with SGLang rollouts; use SGLang's --mem-fraction-static"
    ) in text
    assert "vllm_tensor_parallel_size=2 is not used with SGLang rollouts; use SGLang's --tp-size" in text
    assert "vllm_server_port=8001 is not used with SGLang rollouts; use sglang_urls" in text
    assert "cache_implementation='static' is not used" in text


# --- issue 15 item 8: the collective watchdog vs the project's own timeouts --------------------------


def test_ddp_timeout_is_raised_above_the_main_process_http_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(tmp_path)  # one process: nothing waits in a collective, nothing changes
    assert config.ddp_timeout == 1800 and config.sglang_request_timeout == 1800
    config.use_cpu = False  # accelerators: transformers starts the process group with ddp_timeout
    adapt_trl_fields(config, world_size=2)
    budget = collective_budget_s(config.sync_timeout, 1800, rescoring=False)
    assert config.ddp_timeout == int(budget) > 1800 + config.sync_timeout
    [line] = [r.getMessage() for r in caplog.records if "ddp_timeout=1800" in r.getMessage()]
    assert "collective abort" in line and "lower sglang_request_timeout and sync_timeout" in line
    # Rescoring (a grammar) doubles the request part; a large enough ddp_timeout stays as it is.
    constrained = _config(tmp_path, generation_kwargs={"regex": "[a-z ]+"}, use_cpu=False)
    adapt_trl_fields(constrained, world_size=2)
    assert constrained.ddp_timeout == int(collective_budget_s(constrained.sync_timeout, 1800, rescoring=True))
    roomy = _config(tmp_path, ddp_timeout=99999, use_cpu=False)
    adapt_trl_fields(roomy, world_size=4)
    assert roomy.ddp_timeout == 99999


def test_on_cpu_the_request_timeout_is_fitted_under_torchs_default_watchdog(tmp_path: Path) -> None:
    # use_cpu=True: transformers passes no ddp_timeout, so torch's 1800 s default is the watchdog.
    # 1800 s - 300 s margin - sync_timeout, shared by the two rounds one generate may run (first, in flight).
    config = _config(tmp_path, sync_timeout=600)
    adapt_trl_fields(config, world_size=2)
    assert config.sglang_request_timeout == 450 and config.ddp_timeout == 1800
    # A sync writes (60 s + its bytes), waits and prunes (sync_timeout each): 60 + 2 x 720 + 300 = 1800.
    with pytest.raises(ValueError, match=r"use_cpu=True and 2 processes .*lower sync_timeout to at most 720 s"):
        adapt_trl_fields(_config(tmp_path, sync_timeout=1700), world_size=2)


@pytest.mark.parametrize("use_cpu", [False, True])
@pytest.mark.slow  # subprocesses with torch start-ups: several seconds
def test_two_processes_start_their_process_group_with_the_adapted_timeout(tmp_path: Path, use_cpu: bool) -> None:
    # A real 2-process run: the check must happen before TRL's __post_init__ starts the process group.
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "build_config.py"
    out = tmp_path / "result"
    script.write_text(f"""
import json, torch.distributed as dist
seen = []
real_init = dist.init_process_group
def recording_init(*args, **kwargs):
    seen.append(kwargs["timeout"].total_seconds() if "timeout" in kwargs else None)
    return real_init(*args, **kwargs)
dist.init_process_group = recording_init
from trainer_hooks import GRPOConfig
args = GRPOConfig(output_dir={str(tmp_path / "o")!r}, checkpoint_path={str(tmp_path)!r},
                  sglang_urls={DEAD!r}, sidecar_urls={DEAD!r}, use_cpu={use_cpu!r}, ddp_backend='gloo', bf16=False,
                  report_to='none', per_device_train_batch_size=4, num_generations=4)
open({str(out)!r} + str(args.process_index), "w").write(json.dumps(dict(
    ddp_timeout=args.ddp_timeout, initialized=dist.is_initialized(), pg_timeouts=seen,
    request_timeout=args.sglang_request_timeout)))
""")

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path)
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [json.loads(Path(str(out) + str(i)).read_text()) for i in range(2)]
    expected = int(collective_budget_s(600.0, 1800.0, rescoring=False))
    for r in results:
        assert r["initialized"], r
        if use_cpu:
            # transformers passes no timeout with use_cpu=True (torch's 1800 s default applies), so the request
            # timeout is fitted under it instead.
            assert r["pg_timeouts"] == [None], r
            budget = collective_budget_s(600.0, r["request_timeout"], rescoring=False)
            assert budget <= 1800 < r["request_timeout"] + 1800
        else:
            # The process group itself was started with the adapted timeout.
            assert r["ddp_timeout"] == expected and r["pg_timeouts"] == [expected], r
            assert r["request_timeout"] == 1800.0


# --- through a real SGLang: the fields that change generation or the loss ----------------------------


@pytest.fixture(scope="module")
def unit(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with ready_unit(tiny_model_dir, tmp_path_factory.mktemp("conformance-unit")) as rollout:
        yield rollout


def _train(
    unit: Any,
    model_dir: Path,
    tmp_path: Path,
    config_class: type = GRPOConfig,
    trainer_class: type | None = None,
    **overrides: Any,
) -> tuple[Any, list[list[int]], list[str]]:
    """A short real run; returns the trainer and every completion's token ids and text."""
    from trainer_hooks import GRPOTrainer

    seen_ids: list[list[int]] = []
    seen_text: list[str] = []

    def reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        seen_ids.extend(list(map(int, ids)) for ids in completion_ids)
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        seen_text.extend(texts)
        return [len(t) / 100.0 for t in texts]

    settings = dict(max_steps=1, learning_rate=1e-2)
    settings.update(overrides)
    config = make_config(
        tmp_path, unit.checkpoint_root, [unit.sglang_url], [unit.sidecar_url], config_class=config_class, **settings
    )
    trainer = make_trainer(model_dir, config, trainer_class=trainer_class or GRPOTrainer)
    trainer.reward_funcs = [reward]
    trainer.reward_func_names = ["reward"]
    trainer.parameters_at_start = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    return trainer, seen_ids, seen_text


def _groups(ids: list[list[int]], size: int = 4) -> list[list[list[int]]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


@pytest.mark.sglang
@pytest.mark.parametrize(
    "overrides",
    [
        {"generation_kwargs": {"do_sample": False}},
        {"top_k": 1},
        {"top_p": 1e-6},
    ],
    ids=["do_sample=False", "top_k=1", "top_p=1e-6"],
)
def test_greedy_settings_reach_sglang(
    unit: Any, tiny_model_dir: Path, tmp_path: Path, overrides: dict[str, Any]
) -> None:
    # Each makes SGLang greedy: the num_generations completions of a prompt are identical.
    _, ids, _ = _train(unit, tiny_model_dir, tmp_path, **overrides)
    assert ids and all(all(c == g[0] for c in g) for g in _groups(ids)), _groups(ids)[:2]


@pytest.mark.sglang
def test_sampling_settings_reach_sglang(unit: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    # The default sampling differs within a group; max_completion_length bounds every completion.
    _, ids, _ = _train(unit, tiny_model_dir, tmp_path, max_completion_length=3)
    assert all(1 <= len(c) <= 3 for c in ids)
    assert any(len({tuple(c) for c in g}) > 1 for g in _groups(ids))
    # generation_kwargs' max_new_tokens (SGLang's name) overrides it, as in TRL's own generation.
    _, ids, _ = _train(
        unit, tiny_model_dir, tmp_path / "b", max_completion_length=8, generation_kwargs={"max_tokens": 2}
    )
    assert all(1 <= len(c) <= 2 for c in ids)


@pytest.mark.sglang
def test_structured_outputs_regex_constrains_the_completions(unit: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    import re

    trainer, _, texts = _train(unit, tiny_model_dir, tmp_path, vllm_structured_outputs_regex="[0-9]+")
    assert texts and all(re.fullmatch(r"[0-9]*", t) for t in texts), texts[:8]
    assert trainer.vllm_generation.logprob_source == "rescored"
    is_mean = [
        h["sampling/importance_sampling_ratio/mean"]
        for h in trainer.state.log_history
        if "sampling/importance_sampling_ratio/mean" in h
    ]
    assert is_mean and all(0.8 < m < 1.25 for m in is_mean), is_mean


LOSS_SETTINGS = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "cispo"},
    {"loss_type": "sapo"},
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "vespo"},
    {"beta": 0.04},
    {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1},
    {"num_iterations": 2, "max_steps": 2},
    {"epsilon_high": 0.28, "delta": 1.5},
    {"importance_sampling_level": "sequence"},
    {"top_entropy_quantile": 0.5},
    {"entropy_coef": 0.01},
    {"off_policy_mask_threshold": 0.5},
    {"vllm_importance_sampling_mode": "token_truncate"},
    {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},
    {"scale_rewards": "batch"},
    {"mask_truncated_completions": True, "max_completion_length": 16},
    {"steps_per_generation": 2, "max_steps": 2},
]


LOSS_METRICS = {
    **dict.fromkeys(["grpo", "bnpo", "dr_grpo", "dapo", "luspo"], "clip_ratio/region_mean"),
    "cispo": "cispo_clip_ratio",
    "vespo": "vespo/phi_seq_mean",
    "sapo": None,
}
"""The metric only TRL's loss of that type logs (SAPO logs none of them)."""

TRAINER_ATTRIBUTES = (
    "loss_type",
    "beta",
    "num_iterations",
    "epsilon_high",
    "importance_sampling_level",
    "top_entropy_quantile",
    "entropy_coef",
    "off_policy_mask_threshold",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "scale_rewards",
    "mask_truncated_completions",
)
"""The settings TRL's GRPOTrainer copies from its args onto itself (and reads from there)."""


def _assert_settings_reached_trl(trainer: Any, overrides: dict[str, Any]) -> None:
    """Each setting is what TRL's trainer runs with (its args, and the attribute TRL copies it to), and
    where one is cheap to see, it did what only it does: a KL term, a loss type's own metric, the
    entropy bonus, a synced reference model, fewer generations than steps."""
    from trl.trainer.callbacks import SyncRefModelCallback

    args = trainer.args
    for name, value in overrides.items():
        if name == "generation_kwargs":
            continue
        assert getattr(args, name) == value, (name, getattr(args, name))
        if name in TRAINER_ATTRIBUTES:
            assert getattr(trainer, name) == value, (name, getattr(trainer, name))
    # loss_type: the metric of that loss and none of the others' ("dapo" is also TRL's default).
    loss_type = overrides.get("loss_type", "dapo")
    assert trainer.loss_type == loss_type
    logged_keys = {key for entry in trainer.state.log_history for key in entry}
    own = LOSS_METRICS[loss_type]
    assert own is None or own in logged_keys, (loss_type, sorted(logged_keys))
    assert not {m for m in LOSS_METRICS.values() if m and m != own} & logged_keys, (loss_type, sorted(logged_keys))
    if loss_type == "vespo":  # adapted: TRL's VESPO needs a token-level IS mode with external rollouts
        assert trainer.vllm_importance_sampling_mode == "token_truncate"
    # beta > 0: a reference model and a logged KL term; beta 0 (the default) neither.
    beta = overrides.get("beta", 0.0)
    assert trainer.beta == beta and (trainer.ref_model is not None) == (beta > 0)
    assert ("kl" in logged_keys) == (beta > 0), sorted(logged_keys)
    # epsilon_high: the upper clip differs from epsilon (by default TRL makes them equal).
    assert trainer.epsilon_high == overrides.get("epsilon_high", args.epsilon)
    # entropy_coef: TRL logs the bonus coefficient on every step only while the bonus is on.
    coef = overrides.get("entropy_coef", 0.0)
    assert logged(trainer, "entropy_coef") == pytest.approx([coef] * trainer.state.global_step if coef else []), coef
    # sync_ref_model: the reference model was mixed towards the policy after the step; without it,
    # it stays the starting weights.
    synced = any(isinstance(c, SyncRefModelCallback) for c in trainer.callback_handler.callbacks)
    assert synced == bool(overrides.get("sync_ref_model"))
    if trainer.ref_model is not None:
        start = trainer.parameters_at_start
        moved = any(not torch.equal(start[k], p.detach()) for k, p in trainer.ref_model.named_parameters())
        assert moved == synced, "the reference model moved" if moved else "the reference model did not move"
    # num_iterations / steps_per_generation: one generation serves several optimizer steps.
    steps = trainer.state.global_step
    assert steps == overrides.get("max_steps", 1)
    per_generation = args.num_iterations * args.steps_per_generation
    assert len(trainer.vllm_generation.history) == math.ceil(steps / per_generation), trainer.vllm_generation.history


@pytest.mark.sglang
@pytest.mark.parametrize("overrides", LOSS_SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_loss_settings_train_on_sglang_rollouts(
    unit: Any, tiny_model_dir: Path, tmp_path: Path, overrides: dict[str, Any]
) -> None:
    """Each loss setting reaches TRL, does what only it does where that is cheap to see, and trains on
    SGLang's completions (finite loss, a moved policy, IS ratios near 1)."""
    if overrides.get("mask_truncated_completions"):
        # The tiny model seldom ends a completion: make EOS likelier (SGLang's logit_bias) so that some
        # completions are not truncated and TRL keeps them in the loss.
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
        # Bias 5 makes about half of 16-token completions end early over many runs, but a run's
        # completions go together (6 ended all four of a one-step run early in one CI rehearsal,
        # 5 none of sixteen in another): a run with only one kind is run again with another bias,
        # so that the loss is checked on a mix (the sampling, not the code under test, decides).
        for attempt, bias in enumerate((5.0, 7.0, 3.0)):
            tried = dict(overrides, generation_kwargs={"logit_bias": {str(eos): bias}}, max_steps=4)
            trainer, ids, _ = _train(unit, tiny_model_dir, tmp_path / f"bias-{attempt}", **tried)
            if any(len(c) < 16 for c in ids) and any(len(c) == 16 for c in ids):
                break
        assert any(len(c) < 16 for c in ids) and any(len(c) == 16 for c in ids), [len(c) for c in ids]
        overrides = tried
    else:
        trainer, ids, _ = _train(unit, tiny_model_dir, tmp_path, **overrides)
    _assert_settings_reached_trl(trainer, overrides)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses), trainer.state.log_history
    # The policy moved (the loss produced a gradient through TRL on SGLang's completions) ...
    before = trainer.parameters_at_start
    after = {k: v.detach() for k, v in trainer.model.named_parameters()}
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    # ... and TRL's IS correction saw SGLang's logprobs agree with its own (nothing masked away).
    is_mean = [
        h["sampling/importance_sampling_ratio/mean"]
        for h in trainer.state.log_history
        if "sampling/importance_sampling_ratio/mean" in h
    ]
    assert is_mean and all(0.8 < m < 1.25 for m in is_mean), is_mean


@pytest.mark.sglang
def test_rloo_fields_train_on_sglang_rollouts(unit: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """RLOO generates through the same SGLang backend as GRPO, on the synced weights and without
    asking SGLang for logprobs (RLOO uses none); its own fields reach TRL's RLOOTrainer (beta=0
    against its default 0.05: no reference model, no KL term), and greedy generation_kwargs reach
    SGLang."""
    from trainer_hooks import RLOOTrainer

    trainer, ids, _ = _train(
        unit,
        tiny_model_dir,
        tmp_path,
        config_class=RLOOConfig,
        trainer_class=RLOOTrainer,
        normalize_advantages=True,
        reward_clip_range=(-1.0, 1.0),
        beta=0.0,
        generation_kwargs={"do_sample": False},
    )
    assert all(all(c == g[0] for c in g) for g in _groups(ids))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    assert trainer.args.normalize_advantages is True and trainer.normalize_advantages is True
    assert tuple(trainer.args.reward_clip_range) == tuple(trainer.reward_clip_range) == (-1.0, 1.0)
    assert trainer.args.beta == trainer.beta == 0.0 and trainer.ref_model is None
    assert not logged(trainer, "kl"), trainer.state.log_history
    generation = trainer.vllm_generation
    assert generation.want_logprobs is False  # what the backend sends SGLang as return_logprob
    assert generation.history and all(set(r.versions) == {r.published_version} for r in generation.history)


def test_generation_kwargs_from_the_command_line_are_translated_too(tmp_path: Path) -> None:
    config = _config(tmp_path, generation_kwargs='{"do_sample": false, "stop_strings": ["\\n"]}')
    assert config.generation_kwargs == {"top_k": 1, "stop": ["\n"]}
