"""Failures of SGLang or the sidecar end the training step in a clear error, never a hang.

Driven by the in-process fake (`fake_sglang.FakeRollout`) or a URL nothing listens on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fake_sglang import FakeRollout, dead_url
from trainer_helpers import make_config, make_trainer
from trainer_hooks.replica_wait import ReplicaSyncTimeout
from trainer_hooks.sglang_endpoints import SGLangUnavailableError
from trainer_hooks.stale_retry import StaleWeightsError


def test_dead_sidecar_fails_the_sync_after_sync_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    sidecar = dead_url()
    config = make_config(tmp_path, tmp_path, [dead_url()], [sidecar], sync_timeout=3)
    trainer = make_trainer(tiny_model_dir, config)
    started = time.monotonic()
    with pytest.raises(
        ReplicaSyncTimeout,
        match=rf"did not load checkpoint step-00000001 within sync_timeout=3 s: "
        rf"{sidecar} \(unreachable: ConnectError",
    ):
        trainer.train()
    assert time.monotonic() - started < 30


def test_sidecar_reporting_sglang_down_is_named_in_the_timeout_error(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    fake.wait_status = 504
    fake.wait_body = {
        "loaded_step": None,
        "sglang_healthy": False,
        "rejected": {},
        "last_error": {"reason": "sglang_down", "message": "SGLang at http://x is not answering"},
    }
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=2))
    with pytest.raises(
        ReplicaSyncTimeout,
        match=r"\(loaded nothing, SGLang not healthy, last error: sglang_down: "
        r"SGLang at http://x is not answering\)",
    ):
        trainer.train()


def test_rejected_checkpoint_fails_at_once(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.wait_status = 504
    fake.wait_body = {
        "loaded_step": None,
        "rejected": {"1": "shape_mismatch"},
        "last_error": {"reason": "shape_mismatch", "message": "tensor x has shape [2]"},
    }
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=60))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rejected checkpoint step-00000001 \(shape_mismatch\)"):
        trainer.train()
    assert time.monotonic() - started < 30


def test_dead_sglang_fails_generation_after_sync_timeout(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    server = dead_url()
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [server], [fake.url], sync_timeout=3))
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match=rf"no answer from any SGLang endpoint .*{server}: ConnectError"):
        trainer.train()
    assert 3 <= time.monotonic() - started < 30


def test_hung_sglang_times_out_instead_of_hanging(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.generate_delay_s = 20
    config = make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=2, sglang_request_timeout=1)
    trainer = make_trainer(tiny_model_dir, config)
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match="no (complete )?answer within the timeout"):
        trainer.train()
    assert time.monotonic() - started < 20


def test_stale_answers_are_retried_until_the_replica_catches_up(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    fake.stale_answers = 1
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=1))
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert record.stale_retries == 1 and set(record.versions) == {record.published_version}


def test_answers_from_an_older_version_are_retried_until_the_replica_catches_up(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    """An answer labelled with the version before the one required (max_staleness 0) is not
    trained on: it is generated again, and only the required version's answers are kept."""
    fake.older_answers = 1
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=1))
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert record.required_version == record.published_version == 1
    assert record.stale_retries == 1 and len(fake.generate_requests) == 2
    assert set(record.versions) == {record.published_version}


def test_aborted_answers_are_generated_again(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.abort_answers = 1
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=1))
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert record.stale_retries == 1 and len(fake.generate_requests) == 2


def test_stale_answers_fail_after_sync_timeout(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.fixed_version = "default"
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=3))
    with pytest.raises(
        StaleWeightsError,
        match=r"weights of version\(s\) \['default'\], but the trainer published "
        r"version 1 and max_staleness=0 requires version >= 1",
    ):
        trainer.train()


def test_the_weights_are_gathered_from_the_model_train_wrapped(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL hands the backend the model before ``accelerator.prepare``; ``train()`` then wraps it
    (transformers' ``model_wrapped``: FSDP's root unit, the DeepSpeed engine, DDP). Under FSDP1 the
    pre-prepare object is the module inside the root unit, whose flat parameter holds the
    embeddings, final norm and head: gathered from there, the checkpoint lacked them and every
    sidecar refused it (tests/scripts/fsdp1_gather.py gathers from the root as this does now)."""
    import torch

    from trainer_hooks import sglang_generation

    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=2))
    backend = trainer.vllm_generation
    assert backend.model_source() is trainer.model_wrapped
    wrapped = torch.nn.Module()  # stands in for the root FSDP unit `train()` makes
    trainer.model_wrapped = wrapped
    gathered: list[object] = []

    class Gathered(Exception):
        pass

    def record(model: object, accelerator: object) -> None:
        gathered.append(model)
        raise Gathered

    monkeypatch.setattr(sglang_generation, "iter_full_weights", record)
    with pytest.raises(Gathered):
        backend.sync_weights()
    assert gathered == [wrapped]
