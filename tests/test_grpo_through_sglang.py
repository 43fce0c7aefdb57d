"""GRPO steps through real `rollout-service serve` units (SGLang + sidecar) on the CPU.

One unit per tiny model (untied and tied) is shared by the tests of this module: versions
increase step by step, bounded staleness, TRL's tool loop and evaluation, ack-file waits, and
SGLang's logprobs agreeing with the trainer's after a sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_service.checkpoint_reader import list_checkpoints
from rollout_unit import RolloutUnit, launch_unit, stop_unit, wait_ready
from trainer_helpers import EmbeddingInputs, length_reward, logged, make_config, make_trainer, prompts_dataset
from trainer_hooks import GRPOTrainer

LOGPROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def rollout_units(
    tiny_model_dir: Path, tiny_model_dir_tied: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RolloutUnit]]:
    """Both units (untied and tied model), launched together so that their slow start-ups overlap."""
    units: dict[str, RolloutUnit] = {}
    try:
        units["untied"] = launch_unit(tiny_model_dir, tmp_path_factory.mktemp("unit-untied"))
        units["tied"] = launch_unit(tiny_model_dir_tied, tmp_path_factory.mktemp("unit-tied"))
        yield units
    finally:
        for unit in units.values():
            stop_unit(unit)
    for unit in units.values():  # it held staged copies of the synced steps (RAM, in /dev/shm)
        assert not (unit.checkpoint_root.parent / "stage").exists(), "serve left its stage directory behind"


@pytest.fixture(scope="module")
def untied_unit(rollout_units: dict[str, RolloutUnit]) -> RolloutUnit:
    wait_ready(rollout_units["untied"])
    return rollout_units["untied"]


@pytest.fixture(scope="module")
def tied_unit(rollout_units: dict[str, RolloutUnit]) -> RolloutUnit:
    wait_ready(rollout_units["tied"])
    return rollout_units["tied"]


# --- (a) GRPO steps through the checkpoint root, with (b) and (c) checked along the way ------------------------


def test_grpo_steps_sync_through_checkpoint_path_with_increasing_versions(
    untied_unit: RolloutUnit, tmp_path: Path
) -> None:
    config = make_config(
        tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [untied_unit.sidecar_url], keep_checkpoints=2
    )
    trainer = make_trainer(untied_unit.model_dir, config)
    inputs = EmbeddingInputs(trainer.model)
    try:
        trainer.train()
    finally:
        inputs.close()
    history = list(trainer.vllm_generation.history)
    assert len(history) == 3
    published = [record.published_version for record in history]
    assert published == sorted(set(published)), published  # one new version per step
    for record in history:  # every completion came from the version published for its step
        assert set(record.versions) == {record.published_version}, record
    assert inputs.dtypes and all(d == torch.int64 for d in inputs.dtypes)
    # TRL's own importance-sampling diagnostics: SGLang's logprobs agree with the trainer's.
    assert logged(trainer, "sampling/sampling_logp_difference/max")
    assert max(logged(trainer, "sampling/sampling_logp_difference/max")) < LOGPROB_TOLERANCE
    # Sync metrics reach the trainer's logs.
    assert logged(trainer, "sglang/sync_version") == [float(v) for v in published]
    assert all(v >= 0 for v in logged(trainer, "sglang/sync_wait_s"))
    assert logged(trainer, "sglang/version_lag") == [0.0, 0.0, 0.0]
    # Retention: the newest two versions are left.
    assert [c.step for c in list_checkpoints(untied_unit.checkpoint_root)] == published[-2:]


def test_background_sync_keeps_rollouts_within_max_staleness(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(
        tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [untied_unit.sidecar_url], max_staleness=1
    )
    trainer = make_trainer(untied_unit.model_dir, config)
    trainer.train()  # returns after the last background sync finished (or raises its error)
    generation = trainer.vllm_generation
    assert generation.publisher is not None and not generation.publisher.busy
    assert generation.publisher.confirmed_version == generation.publisher.latest_version
    history = list(generation.history)
    assert len(history) == 3
    first = history[0].published_version
    for record in history:
        assert record.required_version == max(record.published_version - 1, first)
        assert all(v is not None and v >= record.required_version for v in record.versions), record
    assert max(logged(trainer, "sglang/version_lag")) <= 1


def test_trl_tool_loop_runs_multi_turn_through_sglang(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    # TRL's own tool-calling loop: SGLang writes a tool call (forced by SGLang's regex-constrained
    # decoding, passed through generation_kwargs: a random tiny model would not write one), TRL runs
    # the tool, appends its result and asks the backend again for the next turn.
    import re

    import trl

    calls: list[tuple[int, int]] = []

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        calls.append((a, b))
        return a + b

    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    config = make_config(
        tmp_path,
        untied_unit.checkpoint_root,
        [untied_unit.sglang_url],
        [untied_unit.sidecar_url],
        max_steps=1,
        max_completion_length=160,
        max_tool_calling_iterations=1,
        generation_kwargs={"regex": re.escape(tool_call)},
    )
    tokenizer = AutoTokenizer.from_pretrained(untied_unit.model_dir)
    # A chat template TRL knows how to parse tool calls from.
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    seen: list[Any] = []

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(untied_unit.model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=config,
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
        tools=[add],
    )
    trainer.train()
    assert calls == [(1, 2)] * 4  # one call per completion
    assert logged(trainer, "tools/call_frequency") == [1.0] and logged(trainer, "tools/failure_frequency") == [0.0]
    for turns in seen:  # call, the tool's answer, then the next turn generated after it
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"], turns
        assert turns[1]["content"] == "3" and turns[2]["tool_calls"][0]["function"]["name"] == "add"
    # Both turns came from SGLang, on the weights published for the step.
    first, second = trainer.vllm_generation.history
    assert first.published_version == second.published_version is not None
    assert set(first.versions) == set(second.versions) == {first.published_version} and len(second.versions) == 4


def test_evaluation_generates_through_sglang_on_the_synced_weights(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        untied_unit.checkpoint_root,
        [untied_unit.sglang_url],
        [untied_unit.sidecar_url],
        max_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
    )
    model = AutoModelForCausalLM.from_pretrained(untied_unit.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=config,
        train_dataset=prompts_dataset(),
        eval_dataset=prompts_dataset(4),
        processing_class=AutoTokenizer.from_pretrained(untied_unit.model_dir),
    )
    trainer.train()
    assert logged(trainer, "eval_reward"), trainer.state.log_history
    train_records, eval_records = list(trainer.vllm_generation.history)[:2], list(trainer.vllm_generation.history)[2:]
    assert len(train_records) == 2 and eval_records
    # Evaluation after step 2 saw step 2's update: a newer version than the last training rollout.
    for record in eval_records:
        assert record.published_version > train_records[-1].published_version
        assert set(record.versions) == {record.published_version}, record
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_loss" in metrics


def test_grpo_waits_through_ack_files_with_expected_replicas(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(
        tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [], expected_replicas=1, max_steps=1
    )
    trainer = make_trainer(untied_unit.model_dir, config)
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert set(record.versions) == {record.published_version}


# --- (c) SGLang's logprobs match the trainer's after a sync ----------------------------------------------------


def _trainer_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _check_logprobs_match_after_sync(unit: RolloutUnit, tmp_path: Path) -> None:
    temperature = 0.7
    config = make_config(
        tmp_path,
        unit.checkpoint_root,
        [unit.sglang_url],
        [unit.sidecar_url],
        temperature=temperature,
        max_completion_length=12,
    )
    trainer = make_trainer(unit.model_dir, config)
    model = trainer.model
    # Not a deepcopy: the trainer binds an instance-level forward that a copy would still call.
    base = AutoModelForCausalLM.from_pretrained(unit.model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # weights SGLang has never seen: only a sync can make them agree
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.eval()
    generation = trainer.vllm_generation
    generation.sync_weights()
    tokenizer = trainer.processing_class
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for text in ("def main():", "import os")
    ]
    n = 2
    _, completion_ids, logprobs, _ = generation.generate(
        prompts=[p for p in prompts for _ in range(n)], images=None, num_generations=n
    )
    assert set(generation.history[-1].versions) == {generation.publisher.latest_version}
    worst, worst_base = 0.0, 0.0
    for i, completion in enumerate(completion_ids):
        assert completion and all(type(t) is int for t in completion)
        served = torch.tensor([lp[0] for lp in logprobs[i]])
        mine = _trainer_logprobs(model, prompts[i // n], completion, temperature)
        before = _trainer_logprobs(base, prompts[i // n], completion, temperature)
        worst = max(worst, (served - mine).abs().max().item())
        worst_base = max(worst_base, (served - before).abs().max().item())
    assert worst < LOGPROB_TOLERANCE, f"SGLang and trainer logprobs differ by up to {worst:.4f}"
    assert worst_base > 10 * LOGPROB_TOLERANCE, "SGLang still serves the base weights: the sync changed nothing"


def test_sglang_logprobs_match_trainer_after_sync_untied(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    _check_logprobs_match_after_sync(untied_unit, tmp_path)


def test_sglang_logprobs_match_trainer_after_sync_tied(tied_unit: RolloutUnit, tmp_path: Path) -> None:
    _check_logprobs_match_after_sync(tied_unit, tmp_path)
