"""Building trainer_hooks' GRPO/RLOO trainers for tests: a small chat dataset, a reward, a config.

`make_config` fills every setting the tests share (CPU, tiny batches, three steps); keyword
arguments override them. Kept free of server start-ups: the fake and the real rollout unit live
in `fake_sglang` and `rollout_unit`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer_hooks import GRPOConfig, GRPOTrainer

SLOW_SYNC_TIMEOUT_S = 180.0
"""Generous: the CI machines have two cores and other jobs share them."""


def prompts_dataset(count: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"write number {i}"}] for i in range(count)]})


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [len(c[0]["content"]) / 100.0 for c in completions]


def make_config(
    tmp_path: Path,
    root: Path,
    sglang_urls: list[str],
    sidecar_urls: list[str] | None = None,
    config_class: type = GRPOConfig,
    **overrides: Any,
) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        checkpoint_path=str(root),
        sglang_urls=sglang_urls,
        sidecar_urls=sidecar_urls or [],
        report_to="none",
        use_cpu=True,
        bf16=False,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        sync_timeout=SLOW_SYNC_TIMEOUT_S,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return config_class(**settings)


def learning_config(
    out: Path, root: Path, sglang_url: str, sidecar_url: str, *, steps: int, learning_rate: float, **overrides: Any
) -> Any:
    """The settings of the tests that check a run *learns* (its reward rises against a learning-rate-0
    control, with the demo's word-start reward): 32 completions per step (8 per prompt) of 16 tokens,
    a constant learning rate and no KL term, so a few steps move the reward well past the noise."""
    settings: dict[str, Any] = dict(
        output_dir=str(out),
        sidecar_urls=[sidecar_url],
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        report_to=[],
        sync_timeout=300.0,
    )
    settings.update(overrides)
    return make_config(out, root, [sglang_url], **settings)


def make_trainer(model_dir: Path, config: Any, trainer_class: type = GRPOTrainer) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return trainer_class(
        model=model,
        reward_funcs=length_reward,
        args=config,
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )


class EmbeddingInputs:
    """Records the dtype of every tensor that reaches the model's input embedding."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.dtypes: list[torch.dtype] = []
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.dtypes.append(args[0].dtype)

    def close(self) -> None:
        self._handle.remove()


class NoWaiter:
    """A replica waiter with no replicas: a publisher's tests without sidecars."""

    def notify(self, version: int) -> None:
        pass

    def wait(self, version: int, timeout_s: float) -> list[Any]:
        return []

    def protected_versions(self) -> set[int]:
        return set()


def bare_publisher(root: Path, keep: int | None = 2, sync_timeout_s: float = 5.0) -> Any:
    """A ``CheckpointPublisher`` of small untyped tensors into ``root``, with no replicas to wait
    for (:class:`NoWaiter`): retention and numbering tests."""
    from trainer_hooks.checkpoint_publisher import CheckpointPublisher

    return CheckpointPublisher(
        root,
        NoWaiter(),
        config={"model_type": "x"},
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=keep,
        sync_timeout_s=sync_timeout_s,
        heartbeat_max_age_s=60,
    )


def logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


class RecordingWaiter:
    """Records what the publisher asks of the replicas; every version is served at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def notify(self, version: int) -> None:
        self.calls.append(("notify", version))

    def wait(self, version: int, timeout_s: float) -> None:
        self.calls.append(("wait", version))

    def protected_versions(self) -> set[int]:
        return set()
