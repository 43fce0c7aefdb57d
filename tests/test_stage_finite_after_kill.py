"""A staged copy is checked whole for NaN/Inf by the sidecar after it is renamed into place, so a
sidecar killed between the two (OOM, SIGKILL) leaves a copy in the stage that nobody checked. The
restarted sidecar once trusted such a copy as checked: reusing it, or rebuilding the next delta on
it, skipped the whole check, and SGLang loaded a NaN that only the chain's full step held (no
delta changed that tensor, so no per-delta check saw it). Now only a copy this process checked
(``Stage.mark_finite``, called by the controller after its check) lets a build skip it.

Real files throughout: the delta writer publishes, ``Stage`` builds in a tmp folder, and
``validate_checkpoint`` is the controller's check; "killed" is a Stage closed before that check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar.staging import Stage
from rollout_service.untrusted_files import Deadline

CONFIG = {"model_type": "qwen2", "hidden_size": 64}


def _state(step: int, nan: bool) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    s = {"embed": torch.randn(512, 64, generator=g) * 0.05, "mlp": torch.randn(256, 64, generator=g) * 0.05}
    s["mlp"].view(-1)[step % 7 :: 7] += 0.01 * step  # only "mlp" changes from step to step
    if nan:
        s["embed"][3, 5] = float("nan")  # in the full step only: no delta touches "embed"
    return sorted(s.items())


def _publish(root: Path, steps: range, nan: bool) -> None:
    writer = DeltaCheckpointWriter(full_every=100, check_finite=False)  # a writer that let a NaN through
    for step in steps:
        writer.publish(root, step, _state(step, nan), config=CONFIG, dtype="bfloat16", run_id="r")


def _build(stage: Stage, root: Path, step: int):
    path = root / step_dir_name(step)
    return stage.build(root, path, Manifest.load(path, root=root), Deadline(60), check_finite=True)


def _controllers_check(stage: Stage, built) -> None:
    """What the controller does with a build: check it whole unless the build was, then mark it."""
    validate_checkpoint(built.path, root=stage.path, check_finite=not built.finite_checked)
    stage.mark_finite(built.path)


def test_a_copy_a_killed_sidecar_left_unchecked_is_checked_whole_when_reused_or_built_on(tmp_path: Path) -> None:
    root, folder = tmp_path / "root", tmp_path / "stage"
    root.mkdir()
    _publish(root, range(1, 4), nan=True)  # full 1 (with the NaN), deltas 2 and 3
    first = Stage(folder)
    built = _build(first, root, 2)  # replayed from the full step copied in: the caller must check it
    assert not built.finite_checked
    first.close()  # killed here, before the controller's check

    restarted = Stage(folder)
    restarted.prune_before_first_load(None)
    again = _build(restarted, root, 2)
    assert again.path == built.path and again.bytes_read == 0  # reused, not copied again
    assert not again.finite_checked  # nobody checked it: the controller must
    with pytest.raises(CheckpointError) as refused:
        _controllers_check(restarted, again)
    assert refused.value.reason == "non_finite" and "embed" in str(refused.value)
    # The next delta, rebuilt on that unchecked copy, is not taken as checked either.
    on_it = _build(restarted, root, 3)
    assert on_it.chain_length == 1 and not on_it.finite_checked
    with pytest.raises(CheckpointError, match="embed"):
        _controllers_check(restarted, on_it)
    restarted.close()


def test_a_rebuild_on_a_copy_this_process_checked_skips_the_whole_check(tmp_path: Path) -> None:
    root, folder = tmp_path / "root", tmp_path / "stage"
    root.mkdir()
    _publish(root, range(1, 4), nan=False)
    stage = Stage(folder)
    built = _build(stage, root, 2)
    assert not built.finite_checked
    _controllers_check(stage, built)
    on_it = _build(stage, root, 3)  # only the tensors delta 3 changed are checked, in the rebuild
    assert on_it.chain_length == 1 and on_it.finite_checked
    _controllers_check(stage, on_it)
    assert _build(stage, root, 3).finite_checked  # reused, and checked by this process
    stage.close()
