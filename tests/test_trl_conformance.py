"""TRL 1.16 config fields with SGLang rollouts: each works, is adapted with one log line, or is refused
when the config is built with the fix named (docs/trl-conformance.md has the table).

The generation-changing fields are checked through real TRL GRPOTrainer runs on a real SGLang.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from trainer_hooks import GRPOConfig, RLOOConfig
from trainer_hooks.config import adapt_trl_fields, collective_budget_s, translate_generation_kwargs

from test_trainer_hooks import (  # the shared rollout-unit helpers
    SLOW_SYNC_TIMEOUT_S, RolloutUnit, make_config, make_trainer, prompts_dataset, rollout_units, untied_unit,
)

__all__ = ["rollout_units", "untied_unit"]  # module fixtures re-used from test_trainer_hooks

DEAD = ["http://127.0.0.1:9"]


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def _config(tmp_path: Path, config_class: type = GRPOConfig, **overrides: Any) -> Any:
    return make_config(tmp_path, tmp_path, DEAD, DEAD, config_class=config_class, **overrides)


# --- generation_kwargs: SGLang's names --------------------------------------------------------------

def test_transformers_generation_kwargs_are_renamed_or_dropped_with_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(tmp_path, generation_kwargs={
        "do_sample": False, "num_beams": 1, "eos_token_id": 7, "max_tokens": 5, "seed": 3, "use_cache": True,
        "min_p": 0.05, "stop": ["\n"]})
    assert config.generation_kwargs == {"top_k": 1, "stop_token_ids": [7], "max_new_tokens": 5, "sampling_seed": 3,
                                        "min_p": 0.05, "stop": ["\n"]}
    text = _messages(caplog)
    assert "do_sample=False -> top_k=1" in text and "eos_token_id=7 renamed to SGLang's stop_token_ids" in text
    assert "use_cache dropped" in text and "num_beams=1 dropped" in text


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"num_beams": 4}, r"num_beams=4: beam search .*drop num_beams and sample num_generations"),
    ({"length_penalty": 1.2}, r"length_penalty=1.2 has no SGLang counterpart .*only applies to beam search"),
    ({"max_length": 64}, r"max_length=64 .*use max_completion_length"),
    ({"no_repeat_ngram_size": 3}, r"no_repeat_ngram_size=3 .*repetition_penalty / frequency_penalty"),
    ({"num_return_sequences": 4}, r"num_return_sequences=4 .*use num_generations"),
    ({"n": 4}, r"n=4 .*use num_generations"),
    ({"typical_p": 0.9}, r"typical_p=0.9 .*top_p / min_p"),
    ({"bad_words_ids": [[5]]}, r"bad_words_ids=\[\[5\]\] .*logit_bias"),
    ({"temprature": 0.7}, r"temprature=0.7 is not an SGLang sampling parameter .*Use SGLang's names: .*temperature"),
    ({"regex": "a+", "json_schema": "{}"}, r"several SGLang constraints \['regex', 'json_schema'\]"),
])
def test_generation_kwargs_without_an_sglang_counterpart_are_refused_naming_the_fix(
        tmp_path: Path, kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _config(tmp_path, generation_kwargs=kwargs)
    with pytest.raises(ValueError, match=named):
        _config(tmp_path, config_class=RLOOConfig, generation_kwargs=kwargs)


def test_sglang_names_pass_unchanged() -> None:
    kwargs = {"regex": "( [a-z]+)+", "min_new_tokens": 2, "stop_token_ids": [3], "frequency_penalty": 0.1,
              "logit_bias": {"5": -100.0}, "ignore_eos": True, "skip_special_tokens": False}
    assert translate_generation_kwargs(dict(kwargs)) == kwargs


# --- loss and engine fields -------------------------------------------------------------------------

def test_vespo_gets_a_token_level_is_mode_with_one_log_line(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    config = _config(tmp_path, loss_type="vespo")
    assert config.vllm_importance_sampling_mode == "token_truncate"
    assert [r for r in caplog.records if "loss_type='vespo'" in r.getMessage()], caplog.text
    # A token-level mode the user chose stays.
    assert _config(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="token_mask"
                   ).vllm_importance_sampling_mode == "token_mask"


def test_transformers_generation_switches_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"use_transformers_continuous_batching=True asks TRL to generate in the "
                                         r"trainer.*drop use_transformers_continuous_batching"):
        _config(tmp_path, use_transformers_continuous_batching=True)


def test_vllm_engine_settings_are_ignored_with_the_sglang_flag_named(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer_hooks.config")
    _config(tmp_path, vllm_gpu_memory_utilization=0.8, vllm_tensor_parallel_size=2, vllm_server_port=8001,
            cache_implementation="static")
    text = _messages(caplog)
    assert "vllm_gpu_memory_utilization=0.8 is not used with SGLang rollouts; use SGLang's --mem-fraction-static" in text
    assert "vllm_tensor_parallel_size=2 is not used with SGLang rollouts; use SGLang's --tp-size" in text
    assert "vllm_server_port=8001 is not used with SGLang rollouts; use sglang_urls" in text
    assert "cache_implementation='static' is not used" in text


# --- issue 15 item 8: the collective watchdog vs the project's own timeouts --------------------------

def test_ddp_timeout_is_raised_above_the_main_process_http_budget(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
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
    config = _config(tmp_path, sync_timeout=600)
    adapt_trl_fields(config, world_size=2)
    assert config.sglang_request_timeout == 900 and config.ddp_timeout == 1800
    with pytest.raises(ValueError, match=r"use_cpu=True and 2 processes .*lower sync_timeout below 1440"):
        adapt_trl_fields(_config(tmp_path, sync_timeout=1700), world_size=2)


@pytest.mark.parametrize("use_cpu", [False, True])
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
args = GRPOConfig(output_dir={str(tmp_path / 'o')!r}, checkpoint_path={str(tmp_path)!r},
                  sglang_urls={DEAD!r}, sidecar_urls={DEAD!r}, use_cpu={use_cpu!r}, ddp_backend='gloo', bf16=False,
                  report_to='none', per_device_train_batch_size=4, num_generations=4)
open({str(out)!r} + str(args.process_index), "w").write(json.dumps(dict(
    ddp_timeout=args.ddp_timeout, initialized=dist.is_initialized(), pg_timeouts=seen,
    request_timeout=args.sglang_request_timeout)))
""")

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [json.loads(Path(str(out) + str(i)).read_text()) for i in range(2)]
    expected = int(collective_budget_s(600.0, 1800.0, rescoring=False))
    for r in results:
        assert r["initialized"], r
        if use_cpu:
            # transformers passes no timeout with use_cpu=True (torch's 1800 s default applies), so the request
            # timeout is fitted under it instead.
            assert r["pg_timeouts"] == [None], r
            assert collective_budget_s(600.0, r["request_timeout"], rescoring=False) <= 1800 < r["request_timeout"] + 1800
        else:
            # The process group itself was started with the adapted timeout.
            assert r["ddp_timeout"] == expected and r["pg_timeouts"] == [expected], r
            assert r["request_timeout"] == 1800.0
