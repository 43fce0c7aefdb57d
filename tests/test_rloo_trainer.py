"""RLOO generates through the same SGLang backend as GRPO."""

from __future__ import annotations

from pathlib import Path

from fake_sglang import FakeRollout
from trainer_helpers import make_config, make_trainer
from trainer_hooks import RLOOConfig, RLOOTrainer


def test_rloo_trainer_generates_through_the_same_backend(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    config = make_config(tmp_path, tmp_path, [fake.url], [fake.url], config_class=RLOOConfig, max_steps=1)
    trainer = make_trainer(tiny_model_dir, config, trainer_class=RLOOTrainer)
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert set(record.versions) == {1}
    assert fake.generate_requests[0]["return_logprob"] is False
