"""A checkpoint the caller writes itself (the LoRA adapter) goes CheckpointPublisher's one publish
path: ``publish_prepared`` makes it the latest version, waits for the replicas and records the sync,
in the foreground or on the worker thread, and its errors surface as publish's do."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import PublishResult
from rollout_service.protocol import adapter_name_for
from trainer_helpers import RecordingWaiter
from trainer_hooks.adapter_publish import AdapterPublisher
from trainer_hooks.checkpoint_publisher import CheckpointPublisher


def _publisher(root: Path, waiter: RecordingWaiter) -> CheckpointPublisher:
    return CheckpointPublisher(
        root,
        waiter,
        config={},
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=None,
        sync_timeout_s=10,
        heartbeat_max_age_s=10,
    )


def _result(root: Path, version: int, nbytes: int = 123) -> PublishResult:
    return PublishResult(
        path=root / step_dir_name(version),
        step=version,
        weight_version=str(version),
        total_bytes=nbytes,
        tensor_count=1,
        files=1,
        write_seconds=0.0,
        total_seconds=0.0,
        kind="adapter",
    )


def test_a_prepared_write_is_published_waited_for_and_recorded_in_the_foreground(tmp_path: Path) -> None:
    waiter = RecordingWaiter()
    publisher = _publisher(tmp_path, waiter)
    written: list[int] = []

    def write(version: int) -> PublishResult:
        written.append(version)
        assert publisher.latest_version == version  # the latest before its write starts
        return _result(tmp_path, version)

    future = publisher.publish_prepared(publisher.next_version(), write, prepared_s=0.25)
    assert future.done()
    record = future.result()
    assert written == [1] and waiter.calls == [("notify", 1), ("wait", 1)]
    assert (publisher.first_version, publisher.latest_version, publisher.confirmed_version) == (1, 1, 1)
    assert record.version == 1 and record.kind == "adapter" and record.bytes == 123 and not record.background
    assert record.gather_s == 0.25 and record.total_s >= 0.25  # what preparing took counts as the gather
    assert publisher.drain_records() == [record]


def test_a_prepared_write_runs_on_the_worker_thread_in_the_background_and_its_error_is_raised_next(
    tmp_path: Path,
) -> None:
    publisher = _publisher(tmp_path, RecordingWaiter())
    threads: list[str] = []

    def write(version: int) -> PublishResult:
        threads.append(threading.current_thread().name)
        return _result(tmp_path, version)

    record = publisher.publish_prepared(1, write, prepared_s=0.0, background=True).result(timeout=10)
    assert record.background and threads[0].startswith("checkpoint-sync")

    def fail(version: int) -> PublishResult:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publisher.publish_prepared(2, fail, prepared_s=0.0).result()
    assert publisher.confirmed_version == 1  # never waited for
    publisher.publish_prepared(3, fail, prepared_s=0.0, background=True).exception(timeout=10)
    with pytest.raises(RuntimeError, match="background checkpoint sync failed: disk full"):
        publisher.publish_prepared(4, write, prepared_s=0.0)
    publisher.close()


def test_the_adapter_is_published_through_the_publishers_public_path(tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    waiter = RecordingWaiter()
    publisher = _publisher(tmp_path / "ckpts", waiter)
    adapters = AdapterPublisher(publisher, model, "bfloat16")
    assert adapters.current() is None  # nothing served before the first version
    for version in (1, 2):
        record = adapters.publish_and_wait()
        assert record.version == version and record.kind == "adapter"
        assert adapters.current() == (version, adapter_name_for(version, publisher.run_id))
        manifest = Manifest.load(tmp_path / "ckpts" / step_dir_name(version))
        assert manifest.kind == "adapter" and manifest.run_id == publisher.run_id
    assert waiter.calls == [("notify", 1), ("wait", 1), ("notify", 2), ("wait", 2)]
    assert [r.version for r in publisher.drain_records()] == [1, 2]
