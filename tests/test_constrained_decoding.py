"""Constrained decoding (a regex through generation_kwargs) trains, through real TRL and real SGLang.

SGLang returns the logprobs of the *constrained* distribution; TRL's importance-sampling
correction compares them with the trainer's unconstrained logprobs, so every ratio is tiny
(1e-7 .. 1e-28 measured under the regex below) and scales the loss down until the run barely
learns. trainer_hooks rescores
constrained completions with the model's own logprobs (docs/trl-conformance.md), so the ratio
measures only the engine/trainer mismatch again (~1) and the run learns against an lr-0 control.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_demo.demo import make_prompts, word_start_reward
from rollout_unit import ready_unit
from trainer_helpers import learning_config
from trainer_hooks import GRPOTrainer

REGEX = "[0-9]+( [0-9]+)*"
"""Numbers: the tiny random model puts little mass on digits, so the constrained logprobs are far from
its own (TRL's IS ratio measured 1e-7 .. 1e-28 without rescoring, and the run barely learned)."""
STEPS = 10


@pytest.fixture(scope="module")
def unit(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with ready_unit(tiny_model_dir, tmp_path_factory.mktemp("constrained-unit")) as rollout:
        yield rollout


def _run(
    unit: Any, model_dir: Path, out: Path, *, learning_rate: float, steps: int, logprob_source: str | None = None
) -> dict[str, Any]:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    texts: list[str] = []
    base_reward = word_start_reward(tokenizer)

    def reward(completions: list[str], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        texts.extend(completions)
        return base_reward(completions=completions, completion_ids=completion_ids)

    args = learning_config(
        out,
        unit.checkpoint_root,
        unit.sglang_url,
        unit.sidecar_url,
        steps=steps,
        learning_rate=learning_rate,
        keep_checkpoints=3,
        generation_kwargs={"regex": REGEX},
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": make_prompts(max(64, steps * 4))}),
    )
    if logprob_source is not None:
        trainer.vllm_generation.logprob_source = logprob_source
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in history]
    k = max(1, len(rewards) // 4)
    return {
        "rewards": rewards,
        "first": sum(rewards[:k]) / k,
        "last": sum(rewards[-k:]) / k,
        "texts": texts,
        "is_mean": [h["sampling/importance_sampling_ratio/mean"] for h in history],
        "source": trainer.vllm_generation.logprob_source,
    }


@pytest.mark.sglang
def test_constrained_rollouts_learn_against_an_lr_zero_control(unit: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    learned = _run(unit, tiny_model_dir, tmp_path / "lr", learning_rate=2e-2, steps=STEPS)
    control = _run(unit, tiny_model_dir, tmp_path / "lr0", learning_rate=0.0, steps=STEPS)
    assert learned["source"] == "rescored"
    # Every completion obeys the constraint (SGLang sampled under the regex).
    pattern = re.compile(r"[0-9 ]*")
    assert learned["texts"] and all(pattern.fullmatch(t) for t in learned["texts"]), learned["texts"][:5]
    # The IS correction sees matching distributions: ratios ~1, nothing masked away.
    assert all(0.8 < m < 1.25 for m in learned["is_mean"] + control["is_mean"]), (
        learned["is_mean"],
        control["is_mean"],
    )
    gain = learned["last"] - learned["first"]
    assert gain > 0.15, learned["rewards"]
    assert learned["last"] > control["last"] + 0.15, (learned["rewards"], control["rewards"])
    assert abs(control["last"] - control["first"]) < 0.1, control["rewards"]


@pytest.mark.sglang
def test_constrained_logprobs_as_sampled_give_vanishing_is_ratios(
    unit: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The failure this guards against: SGLang's constrained logprobs handed to TRL as they are.
    sampled = _run(unit, tiny_model_dir, tmp_path / "sampled", learning_rate=0.0, steps=2, logprob_source="sampled")
    assert all(m < 1e-3 for m in sampled["is_mean"]), sampled["is_mean"]


class _NotMain:
    is_main_process = False
    num_processes = 1
    process_index = 0


@pytest.mark.parametrize(
    ("kwargs", "temperature", "source"),
    [
        ({"regex": "[a-z]+"}, 1.0, "rescored"),
        ({"logit_bias": {"5": -100.0}}, 1.0, "rescored"),
        ({"frequency_penalty": 0.2}, 1.0, "rescored"),
        ({}, 1.0, "sampled"),
        ({"top_k": 5, "min_p": 0.1}, 0.7, "sampled"),
        ({"regex": "[a-z]+"}, 0.7, "none"),
    ],
)
def test_which_logprobs_reach_the_is_correction(
    kwargs: dict[str, Any], temperature: float, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    from trainer_hooks.sglang_generation import SGLangGeneration

    # Not the main process: the sampling arguments alone decide, no publisher or SGLang needed.
    gen = SGLangGeneration(None, _NotMain(), None, temperature=temperature, generation_kwargs=kwargs)
    assert gen.logprob_source == source
    if source == "none":
        assert "Use temperature=1.0 to keep it" in "\n".join(r.getMessage() for r in caplog.records)
    # RLOO asks for no logprobs at all: nothing to rescore.
    assert SGLangGeneration(None, _NotMain(), None, logprobs=None, generation_kwargs=kwargs).logprob_source == "sampled"


@pytest.mark.sglang
@pytest.mark.parametrize("correction", [True, False], ids=["correction-on", "correction-off"])
def test_constrained_rollouts_are_rescored_only_when_trl_reads_the_logprobs(
    unit: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, correction: bool
) -> None:
    """With the importance-sampling correction off (and no off-policy mask) TRL drops the engine's
    logprobs: the real SGLang server gets no rescore request then (a review, session 31: every
    batch paid a second, prefill-only request for nothing). The requests are watched on their
    way out (the real server answers them); with the correction on, the same run rescores."""
    from trainer_hooks.sglang_endpoints import SGLangEndpoints

    sent: list[bool] = []
    request = SGLangEndpoints._request

    def watched(self: Any, client: Any, url: str, payload: Any, *, tokens: int, rescoring: bool = False) -> Any:
        sent.append(rescoring)
        return request(self, client, url, payload, tokens=tokens, rescoring=rescoring)

    monkeypatch.setattr(SGLangEndpoints, "_request", watched)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    args = learning_config(
        tmp_path / "out",
        unit.checkpoint_root,
        unit.sglang_url,
        unit.sidecar_url,
        steps=1,
        learning_rate=0.0,
        generation_kwargs={"regex": REGEX},
        vllm_importance_sampling_correction=correction,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
        reward_funcs=word_start_reward(tokenizer),
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": make_prompts(16)}),
    )
    trainer.train()
    assert trainer.vllm_generation.logprob_source == ("rescored" if correction else "sampled")
    assert sent and (True in sent) == correction, sent
