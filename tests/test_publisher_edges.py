"""The trainer's publisher at its edges (a review of the publishing side):

- a relative checkpoint root: every manifest was read relative to the root a second time and
  not found, so retention kept every step (``keep_checkpoints`` ignored, the root filled) and a
  second trainer numbering into the same root went unnoticed;
- ``close()`` left the delta writer's encode threads (and their buffers) running;
- a tensor of a dtype no checkpoint holds (complex, uint16) failed with a bare ``TypeError``
  naming neither the tensor nor what to do, and in delta mode it dropped the copy of the last
  version, so the next publish was full.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from delta_helpers import Model
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import PublishRefused
from rollout_service.delta_writer import DeltaCheckpointWriter
from test_publish_failures import _publisher


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


@pytest.mark.parametrize("delta", [False, True])
def test_a_relative_root_keeps_only_the_newest_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delta: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    model = Model(lr=1e-6)
    publisher = _publisher(Path("rel"), DeltaCheckpointWriter(full_every=2) if delta else None, keep=2)
    try:
        for _ in range(4):
            model.step()
            record = publisher.publish_and_wait(publisher.next_version(), model.tensors())
        assert record.pruned, "nothing was pruned"
    finally:
        publisher.close()
    root = tmp_path / "rel"
    kept = _steps(root)
    assert kept == [step_dir_name(3), step_dir_name(4)], kept
    kinds = ["full", "delta"] if delta else ["full", "full"]  # (the chain of step 4 starts at step 3)
    assert [Manifest.load(root / s).kind for s in kept] == kinds


def test_a_second_trainer_under_a_relative_root_is_noticed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = Model(lr=1e-6)
    first, second = _publisher(Path("rel")), _publisher(Path("rel"))
    try:
        first.publish_and_wait(first.next_version(), model.tensors())
        second.publish_and_wait(second.next_version(), model.tensors())  # numbers above the first's step
        with pytest.raises(RuntimeError, match="published by another run"):
            first.publish_and_wait(first.next_version(), model.tensors())
    finally:
        for publisher in (first, second):
            publisher.close()


def test_close_stops_the_delta_writers_encode_threads(tmp_path: Path) -> None:
    before = set(threading.enumerate())  # (other tests' writers may still hold theirs)
    model = Model(lr=1e-6)
    publisher = _publisher(tmp_path / "root", DeltaCheckpointWriter(full_every=100, threads=3))
    for background in (False, True, True):
        model.step()
        version = publisher.next_version()
        if background:
            publisher.publish_in_background(version, model.tensors())
        else:
            publisher.publish_and_wait(version, model.tensors())
    publisher.close()
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("delta-encode")]
    assert left == [], left
    model.step()  # a publish after close (evaluate() after train()) still works, as a delta
    assert publisher.publish_and_wait(publisher.next_version(), model.tensors()).kind == "delta"
    publisher.close()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16])
@pytest.mark.parametrize("delta", [False, True])
def test_a_tensor_no_checkpoint_holds_is_refused_by_name_and_the_chain_goes_on(
    tmp_path: Path, dtype: torch.dtype, delta: bool
) -> None:
    model = Model(lr=1e-6)
    publisher = _publisher(tmp_path / "root", DeltaCheckpointWriter(full_every=100) if delta else None)
    try:
        publisher.publish_and_wait(publisher.next_version(), model.tensors())
        model.step()
        odd = [*model.tensors(), ("rotary.freqs", torch.zeros(4, dtype=dtype))]
        with pytest.raises(
            PublishRefused, match=r"'rotary\.freqs' is torch\.\w+, which a checkpoint cannot hold"
        ) as err:
            publisher.publish_and_wait(publisher.next_version(), odd)
        assert (err.value.rule, err.value.tensor) == ("dtype", "rotary.freqs")
        assert _steps(tmp_path / "root") == [step_dir_name(1)]
        record = publisher.publish_and_wait(publisher.next_version(), model.tensors())
        assert record.kind == ("delta" if delta else "full")  # the copy of version 1 was kept
    finally:
        publisher.close()
