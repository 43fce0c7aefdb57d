"""One-shot commands stopped midway leave nothing half-done: SIGTERM (what ``timeout``,
Kubernetes and systemd send) interrupts them as Ctrl-C does, so their clean-up runs, and both end
with one line and the signal's exit status instead of a traceback. A ``materialize`` killed
outright leaves a hidden work folder that the next run into the same place removes, and one
into a file system without room for the model is refused before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollout_service import delta_apply
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_apply import materialize
from rollout_service.work_folders import owner_tag

MODEL_ELEMENTS = 96 << 20  # 384 MB of float32: a copy with every byte hashed takes a while


@pytest.fixture(scope="module")
def big_root(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("big") / "root"
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(MODEL_ELEMENTS // 1024, 1024, generator=g)}
    publish_checkpoint(root, 1, tensors.items(), config=tiny_model_dir / "config.json", max_shard_bytes=64 << 20)
    return root


def sigint_as_a_terminal_sends_it() -> None:
    """In the child: SIGINT back to its default. A shell that starts the test run in the
    background (CI) makes it ignored, and a process started ignoring it keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def work_folders(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".tmp-materialize-"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_an_interrupted_materialize_removes_its_work_and_says_so(big_root: Path, tmp_path: Path, sig) -> None:
    out = tmp_path / "model"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "materialize", str(big_root), "--step", "1", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_a_terminal_sends_it,
    )
    deadline = time.monotonic() + 60
    while not work_folders(tmp_path):  # it is working: interrupt it there
        assert proc.poll() is None, f"materialize ended before it was interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "materialize never started its work"
        time.sleep(0.002)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted by {signal.Signals(sig).name}" in err and "Traceback" not in err, err
    assert work_folders(tmp_path) == [] and not out.exists()


def test_the_work_of_a_killed_materialize_is_removed_by_the_next_run(big_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = {
        "killed": f".tmp-materialize-model-{owner_tag(dead.pid)}-00000000aaaa",
        "live": f".tmp-materialize-model-{owner_tag()}-00000000bbbb",  # this process: still running
        "elsewhere": f".tmp-materialize-model-h00000000p{dead.pid}-00000000cccc",  # another host's: unknowable
        "another-out": f".tmp-materialize-model2-{owner_tag(dead.pid)}-00000000dddd",
    }
    for name in left.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    materialize(big_root, 1, out)
    assert (out / "config.json").exists()
    assert work_folders(tmp_path) == sorted(left[k] for k in ("live", "elsewhere", "another-out"))


def test_materialize_refuses_a_file_system_without_room_before_writing(
    big_root: Path, tmp_path: Path, monkeypatch
) -> None:
    real = os.statvfs

    class Small:
        f_frsize = 4096
        f_bavail = (100 << 20) // 4096  # 100 MB free for a 384 MB model

    monkeypatch.setattr(delta_apply.os, "statvfs", lambda p: Small() if Path(p) == tmp_path else real(p))
    with pytest.raises(ValueError, match=r"has 104\.9 MB free, and rebuilding step 1 needs 402\.7 MB"):
        materialize(big_root, 1, tmp_path / "model")
    assert os.listdir(tmp_path) == []


def test_an_interrupted_publish_leaves_no_work_folder_in_the_root(big_root: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    materialize(big_root, 1, model)
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "publish", "--model-dir", str(model)]
        + ["--checkpoint-path", str(root), "--step", "7"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any(n.startswith(".tmp-") for n in os.listdir(root)):
        assert proc.poll() is None, f"publish ended before it was interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "publish never started its work"
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err, err
    assert os.listdir(root) == []


def test_a_signal_after_the_rename_reports_the_step_published(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A SIGTERM that lands once the step is renamed into place (while the root is synced) must
    not report a failure: the step is visible and complete, and a retry would be refused."""
    from rollout_service import checkpoint_writer, cli

    root = tmp_path / "root"
    real_fsync_dir = checkpoint_writer.fsync_dir

    def signal_after_the_rename(path: Path) -> None:
        real_fsync_dir(path)
        if Path(path) == root:  # synced last, after the rename
            cli._interrupt(signal.SIGTERM, None)  # what the installed handler does when SIGTERM arrives

    monkeypatch.setattr(checkpoint_writer, "fsync_dir", signal_after_the_rename)
    argv = ["publish", "--model-dir", str(tiny_model_dir), "--checkpoint-path", str(root), "--step", "3"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "interrupted by SIGTERM after" in err and "it stays published" in err, err
    printed = json.loads(out)
    assert printed["published"] == str(root / "step-00000003") and printed["step"] == 3
    assert sorted(os.listdir(root)) == ["step-00000003"]


def test_a_signal_before_the_rename_still_reports_the_interruption(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The other side of that line: interrupted while the work folder is synced, nothing is
    published and the exit status says so."""
    from rollout_service import checkpoint_writer, cli

    root = tmp_path / "root"
    real_fsync_dir = checkpoint_writer.fsync_dir

    def signal_before_the_rename(path: Path) -> None:
        real_fsync_dir(path)
        if Path(path).name.startswith(".tmp-"):
            cli._interrupt(signal.SIGTERM, None)

    monkeypatch.setattr(checkpoint_writer, "fsync_dir", signal_before_the_rename)
    argv = ["publish", "--model-dir", str(tiny_model_dir), "--checkpoint-path", str(root), "--step", "3"]
    assert cli.main(argv) == 128 + signal.SIGTERM
    out, err = capsys.readouterr()
    assert out == "" and "interrupted by SIGTERM: stopped" in err, err
    assert os.listdir(root) == []


def test_an_interrupted_rebuild_does_not_wait_for_the_rest_of_the_shard(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C or SIGTERM while a delta shard is rebuilt: the parts not yet started never start,
    so the command stops after the part or two per thread in flight, not after the whole shard."""
    from delta_helpers import CONFIG, RUN, Model
    from rollout_service.delta_writer import DeltaCheckpointWriter

    model = Model(shapes={f"layer{i}.w": (64, 64) for i in range(48)})
    writer, root = DeltaCheckpointWriter(full_every=10), tmp_path / "root"
    for step in (1, 2):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    started: list[int] = []
    real_part = delta_apply._rebuild_part

    def slow_part(*args):
        started.append(args[-1])
        time.sleep(0.02)
        return real_part(*args)

    def interrupted_wait(jobs):
        raise KeyboardInterrupt  # what the SIGTERM handler raises in the main thread, waiting here

    monkeypatch.setattr(delta_apply, "_rebuild_part", slow_part)
    monkeypatch.setattr(delta_apply, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        materialize(root, 2, tmp_path / "model")
    assert len(started) <= 2 * delta_apply.APPLY_THREADS, f"{len(started)} of 48 parts ran after the interrupt"
    assert sorted(os.listdir(tmp_path)) == ["root"]
