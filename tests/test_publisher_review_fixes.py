"""Defects a review of the trainer's publishing side found, each pinned by a test:

- a delta of a model with very many tensors (or very long names) had a manifest larger than readers
  read: every replica refused it, and retention passed it over as "not the manifest of its step";
  such a version is published in full now, and retention counts a too-large manifest as one it
  cannot read (it deletes nothing that step's chain might need);
- a link planted in a writer's work folder made it overwrite a file outside the root: the folder is
  the writer's alone while it is written, and every file in it is made new, never through a link;
- retention deleted a step a live replica serves when ``acks/`` held more entries than are read;
- an I/O error while reading (not opening) a manifest escaped as a bare ``OSError``, ending training;
- the next sync waited forever for a background write blocked in the storage;
- a root found gone before a foreground write left the collective weight iterator undrained;
- an empty folder or a link at a step's name was reported as "already published".
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rollout_service.adapter_writer as aw
import rollout_service.delta_writer as dw
from delta_helpers import CONFIG, RUN, Model
from rollout_service import checkpoint_writer, protocol, untrusted_files
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar.acks import write_ack
from test_publish_failures import _publisher
from trainer_helpers import NoWaiter
from trainer_hooks import checkpoint_publisher, checkpoint_retention
from trainer_hooks.checkpoint_publisher import CheckpointPublisher
from trainer_hooks.checkpoint_retention import chain_dependencies, prune_checkpoints
from trainer_hooks.replica_wait import AckFileWaiter

READERS_CAP = 16 << 20
"""What readers read of a manifest (``untrusted_files.MAX_SMALL_FILE_BYTES``)."""


# --- delta manifests larger than readers read ------------------------------------------------


def _long_named_state(step: int) -> list[tuple[str, torch.Tensor]]:
    """20 tensors whose names make ~18 MB: a full checkpoint holds them in its shard header (readers
    take 100 MiB there), a delta's manifest lists them all (readers take 16 MiB)."""
    return [(f"layer{i:02d}." + "x" * 900_000, torch.full((64,), float(step + i) / 7)) for i in range(20)]


def test_a_delta_whose_manifest_readers_would_refuse_is_published_in_full(tmp_path: Path) -> None:
    root = tmp_path / "root"
    writer = DeltaCheckpointWriter(full_every=100)
    kw: dict[str, Any] = dict(config=CONFIG, dtype="bfloat16", max_shard_bytes=1 << 30, run_id=RUN)
    try:
        writer.publish(root, 1, _long_named_state(1), **kw)
        result = writer.publish(root, 2, _long_named_state(2), **kw)
    finally:
        writer.close()
    manifest = Manifest.load(root / step_dir_name(2))  # readers read it
    assert manifest.kind == "full" and result.kind == "full", (result.kind, writer.last.why_full)
    assert "more than the 16 MiB readers read" in writer.last.why_full and "20" in writer.last.why_full
    assert (root / step_dir_name(2) / "manifest.json").stat().st_size < 1 << 20


def test_a_delta_whose_changes_push_its_manifest_past_the_cap_is_published_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its size is known (serialised with stand-in digests) before anything of the delta is written."""
    root, model = tmp_path / "root", Model(lr=1e-3)
    writer = DeltaCheckpointWriter(full_every=100)
    kw: dict[str, Any] = dict(config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    model.step()
    writer.publish(root, 1, model.tensors(), **kw)
    model.step()
    writer.publish(root, 2, model.tensors(), **kw)
    assert writer.last.kind == "delta"
    delta_bytes = (root / step_dir_name(2) / "manifest.json").stat().st_size
    floor = writer._delta_manifest_floor(writer._base, 40_000)  # type: ignore[arg-type]
    assert floor < delta_bytes  # the changed tensors' frames and delta files come on top
    monkeypatch.setattr(dw, "MAX_MANIFEST_BYTES", floor + dw.MANIFEST_TIME_SLACK + 1)
    model.step()
    writer.publish(root, 3, model.tensors(), **kw)
    writer.close()
    assert writer.last.kind == "full" and "changed" in writer.last.why_full, writer.last.why_full
    assert Manifest.load(root / step_dir_name(3)).kind == "full"


def test_a_manifest_larger_than_readers_read_is_unreadable_to_retention_not_a_stray(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a step (a delta of a huge model, from before the writer refused those) may be a real
    checkpoint whose chain is needed: it takes its ``keep`` slot and protects what it might need."""
    root = tmp_path / "root"
    for step in (1, 2):
        publish_checkpoint(root, step, [("w", torch.full((4,), float(step)))], config=CONFIG, run_id=RUN)
    big = root / step_dir_name(3)
    big.mkdir()
    (big / "manifest.json").write_bytes(b"{" + b" " * READERS_CAP + b"}")
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        removed = prune_checkpoints(root, keep=1)
    assert removed == [], "deleted steps a manifest it could not read might need"
    assert [c.step for c in list_checkpoints(root)] == [1, 2, 3]
    assert "not the manifest of their step" not in caplog.text
    assert "not deleting old checkpoints" in caplog.text
    with pytest.raises(CheckpointError) as raised:
        chain_dependencies(root, {3})
    assert raised.value.reason == "too_large"


# --- a link planted in the work folder -------------------------------------------------------


def _work_folder(root: Path) -> Path:
    (found,) = [p for p in root.iterdir() if p.name.startswith(".tmp-step-")]
    return found


def test_a_link_planted_in_the_work_folder_is_not_written_through(tmp_path: Path) -> None:
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    victim.write_text("precious data outside the checkpoint root\n")
    modes: list[int] = []

    def gather() -> Iterator[tuple[str, torch.Tensor]]:
        work = _work_folder(root)  # the writer made its folder: another process plants a link there
        modes.append(work.stat().st_mode & 0o777)
        os.symlink(victim, work / "shard-00001.part")
        yield "w", torch.ones(4)

    with pytest.raises(FileExistsError, match="shard-00001.part exists already in the work folder"):
        publish_checkpoint(root, 1, gather(), config=CONFIG, run_id=RUN)
    assert victim.read_text() == "precious data outside the checkpoint root\n"
    assert os.listdir(root) == []
    assert modes == [0o700], "the work folder is its writer's alone while it is written"


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_a_published_step_has_the_modes_it_always_had(tmp_path: Path, mask: int) -> None:
    """The work folder's own mode is undone just before the rename: readers of other users read it."""
    with _umask(mask):
        path = publish_checkpoint(tmp_path, 1, [("w", torch.ones(4))], config=CONFIG, run_id=RUN).path
    assert path.stat().st_mode & 0o7777 == 0o777 & ~mask
    for f in path.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f.name


def _planting(module: Any, monkeypatch: pytest.MonkeyPatch, name: str, victim: Path) -> None:
    """Make ``module``'s work folders receive a link ``name`` -> ``victim`` as soon as they exist."""
    real = module.atomic_step_dir

    @contextlib.contextmanager
    def planted(root: Path | str, step: int) -> Iterator[Path]:
        with real(root, step) as tmp:
            os.symlink(victim, tmp / name)
            yield tmp

    monkeypatch.setattr(module, "atomic_step_dir", planted)


@pytest.mark.parametrize("name", ["delta file", "model.safetensors.index.json", "config.json", "manifest.json"])
def test_the_delta_writer_makes_its_files_new_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    root, victim, model = tmp_path / "root", tmp_path / "victim.txt", Model(lr=1e-3)
    victim.write_text("precious\n")
    writer = DeltaCheckpointWriter(full_every=100)
    kw: dict[str, Any] = dict(config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    model.step()
    writer.publish(root, 1, model.tensors(), **kw)
    if name == "delta file":  # the first shard's (every tensor changes at each step)
        shards = len(list((root / step_dir_name(1)).glob("model-*.safetensors")))
        name = f"delta-00001-of-{shards:05d}.safetensors"
    _planting(dw, monkeypatch, name, victim)
    model.step()
    with pytest.raises(FileExistsError, match="exists already in the work folder"):
        writer.publish(root, 2, model.tensors(), **kw)
    writer.close()
    assert victim.read_text() == "precious\n"
    assert [c.step for c in list_checkpoints(root)] == [1]


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_the_adapter_writer_makes_its_files_new_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    _planting(aw, monkeypatch, name, victim)
    lora = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(16, 4),
    }
    with pytest.raises(FileExistsError, match="exists already in the work folder"):
        publish_adapter(root, 1, lora, {"peft_type": "LORA", "r": 4, "lora_alpha": 8}, run_id=RUN)
    assert victim.read_text() == "precious\n"
    assert os.listdir(root) == []


# --- acks/ flooded -----------------------------------------------------------------------------


def _ack_past_the_cap(root: Path, cap: int, payload: dict[str, Any]) -> None:
    """An ack of a live replica that a listing of ``acks/`` (in the file system's order) reaches only
    after ``cap`` stray entries."""
    acks = root / "acks"
    for k in range(50):
        write_ack(root, f"r{k}", payload)
        for i in range(2 * cap):
            (acks / f"junk-{k}-{i}").touch()
        if [e.name for e in os.scandir(acks)].index(f"r{k}.json") >= cap:
            return
        (acks / f"r{k}.json").unlink()
    raise AssertionError("no ack of 50 was listed after the strays: the test cannot set up a cut-short listing here")


def test_retention_deletes_nothing_while_the_acks_cannot_all_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(protocol, "MAX_ACK_ENTRIES", 40)
    root = tmp_path / "root"
    pub = _publisher(root, keep=1)
    pub.publish_and_wait(1, [("w", torch.ones(8))])
    _ack_past_the_cap(root, 40, {"loaded_step": 1, "loading_step": None})
    listing = protocol.list_acks(root)
    assert listing.cut_short is not None and listing.acks == {}
    with caplog.at_level(logging.DEBUG, logger="trainer_hooks.checkpoint_publisher"):
        for version in (2, 3):
            pub.publish_and_wait(version, [("w", torch.full((8,), float(version)))])
    assert [c.step for c in list_checkpoints(root)] == [1, 2, 3], "deleted a step a live replica serves"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not deleting" in r.getMessage()]
    assert len(warnings) == 1, "said once, not at every publish"
    assert "holds more than 40 entries" in warnings[0].getMessage()
    for stray in (root / "acks").glob("junk-*"):
        stray.unlink()
    with caplog.at_level(logging.INFO, logger="trainer_hooks.checkpoint_publisher"):
        pub.publish_and_wait(4, [("w", torch.full((8,), 4.0))])
    assert [c.step for c in list_checkpoints(root)] == [1, 4], "step 1 is served: the rest go"
    assert "deleted again" in caplog.text


def test_the_ack_waiter_does_not_report_what_replicas_hold_from_part_of_the_acks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol, "MAX_ACK_ENTRIES", 40)
    _ack_past_the_cap(tmp_path, 40, {"loaded_step": 1, "loading_step": None})
    waiter = AckFileWaiter(tmp_path, 1, max_age_s=60)
    try:
        steps = waiter.protected_versions()
    except Exception as exc:
        assert type(exc).__name__ == "AcksCutShort" and "holds more than 40 entries" in str(exc), repr(exc)
    else:
        pytest.fail(f"reported {steps} from part of the acks")


# --- an I/O error while a manifest is read ---------------------------------------------------


class _FailingRead:
    """``os`` for ``untrusted_files``, whose ``read`` of step 2's manifest fails with EIO."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def read(fd: int, n: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f"{step_dir_name(2)}/manifest.json"):
            raise OSError(errno.EIO, "Input/output error")
        return os.read(fd, n)


def test_an_io_error_reading_a_manifest_is_an_unreadable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    pub = _publisher(root, keep=1)
    for version in (1, 2):
        pub.publish_and_wait(version, [("w", torch.full((8,), float(version)))])
    monkeypatch.setattr(untrusted_files, "os", _FailingRead())
    with pytest.raises(CheckpointError) as raised:
        Manifest.load(root / step_dir_name(2))
    error = raised.value
    assert error.reason == "unreadable" and f"{step_dir_name(2)}/manifest.json" in str(error), str(error)
    # Still the OSError it was, for code that tells the storage's faults by it (the sidecar's stage).
    assert isinstance(error, OSError) and error.errno == errno.EIO
    assert pub.next_version() == 3, "numbering on: an unreadable step still counts"
    with pytest.raises(CheckpointError, match="Input/output error"):
        chain_dependencies(root, {2})
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        assert prune_checkpoints(root, keep=1) == []
    assert "not deleting old checkpoints" in caplog.text


# --- a background write blocked in the storage -----------------------------------------------


def _bounded_publisher(root: Path, monkeypatch: pytest.MonkeyPatch, sync_timeout_s: float) -> CheckpointPublisher:
    """A publisher whose background jobs may take ~2 x ``sync_timeout_s`` (no allowance for the write)."""
    for name, value in (("WRITE_ALLOWANCE_BASE_S", 0.0), ("JOIN_POLL_S", 0.1), ("JOIN_PROGRESS_EVERY_S", 0.5)):
        monkeypatch.setattr(checkpoint_publisher, name, value, raising=False)
    return CheckpointPublisher(
        root,
        NoWaiter(),
        config=CONFIG,
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=None,
        sync_timeout_s=sync_timeout_s,
        heartbeat_max_age_s=60,
    )


def _ended_within(call: Callable[[], object], seconds: float, release: threading.Event) -> list[BaseException | None]:
    """Run ``call`` on a thread for up to ``seconds``, then set ``release`` (the storage answers
    again); ``[what it raised]`` (``[None]``: it returned), or ``[]`` when it had not ended."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    release.set()
    return outcome


def _assert_blocked_write_named(error: BaseException | None, root: Path) -> None:
    from rollout_service.sidecar.root_gate import RootUnresponsive

    assert isinstance(error, RootUnresponsive), repr(error)
    assert "version 2" in str(error) and str(root) in str(error) and "has written nothing for" in str(error)


def test_the_next_sync_gives_up_on_a_background_write_blocked_in_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    root = tmp_path / "root"
    pub = _bounded_publisher(root, monkeypatch, sync_timeout_s=1.0)
    pub.publish_and_wait(1, [("w", torch.ones(4))])
    hang = threading.Event()
    real = checkpoint_writer.write_all

    def blocked(fd: int, data: Any) -> None:
        hang.wait(60)  # stands for write(2) blocked in the kernel on a hung NFS server
        real(fd, data)

    monkeypatch.setattr(checkpoint_writer, "write_all", blocked)
    pub.publish_in_background(2, [("w", torch.ones(4))])
    with caplog.at_level(logging.INFO, logger="trainer_hooks.checkpoint_publisher"):
        outcome = _ended_within(lambda: pub.publish_in_background(3, [("w", torch.ones(4))]), 15, hang)
    assert outcome, "the next sync still waits for the blocked write"
    _assert_blocked_write_named(outcome[0], root)
    assert "waiting for the sync of version 2" in caplog.text
    pub.close()  # the write is released: it finishes
    assert [c.step for c in list_checkpoints(root)] == [1, 2]


@pytest.mark.parametrize("delta", [False, True], ids=["streamed", "delta"])
def test_a_foreground_sync_gives_up_on_a_write_blocked_in_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, delta: bool
) -> None:
    """``max_staleness=0`` (the default) writes every sync in the foreground: a write blocked in
    the storage hung the trainer for good, without a line in its log (the other ranks then died
    in the NCCL watchdog). It now ends like a blocked background write, and every weight is still
    drawn (gathers are collective)."""
    from rollout_service.delta_writer import DeltaCheckpointWriter

    root = tmp_path / "root"
    pub = _bounded_publisher(root, monkeypatch, sync_timeout_s=1.0)
    if delta:
        pub.delta = DeltaCheckpointWriter(full_every=100)
    weights = [(f"w{i}", torch.full((64,), float(i))) for i in range(8)]
    pub.publish_and_wait(1, weights)
    hang = threading.Event()
    real = checkpoint_writer.write_all
    monkeypatch.setattr(checkpoint_writer, "write_all", lambda fd, data: (hang.wait(60), real(fd, data)))
    drawn: list[str] = []

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            drawn.append(name)
            yield name, t + 1

    with caplog.at_level(logging.INFO, logger="trainer_hooks.checkpoint_publisher"):
        outcome = _ended_within(lambda: pub.publish_and_wait(2, gathered()), 15, hang)
    assert outcome, "the foreground sync still hangs on the blocked write"
    _assert_blocked_write_named(outcome[0], root)
    assert "waiting for the sync of version 2" in caplog.text  # progress while it waited
    assert drawn == [name for name, _ in weights]  # every gather ran
    pub.close()  # the write is released: it finishes (waited for, as a pending job)
    assert [c.step for c in list_checkpoints(root)] == [1, 2]


def test_a_foreground_sync_whose_gather_fails_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    """The weights are drawn on the calling thread and written on the job's: a gather that fails
    there leaves the write without its weights, which must fail it (nothing is published)."""
    root = tmp_path / "root"
    pub = _bounded_publisher(root, monkeypatch, sync_timeout_s=1.0)

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w0", torch.ones(4)
        raise RuntimeError("CUDA out of memory in the gather")

    with pytest.raises(RuntimeError, match="out of memory in the gather"):
        pub.publish_and_wait(1, gathered())
    time.sleep(1.0)  # the job notices within JOIN_POLL_S
    assert list_checkpoints(root) == []
    assert not [p for p in root.iterdir() if p.name.startswith("step-")]
    pub.publish_and_wait(1, [("w0", torch.ones(4))])  # the next sync goes on
    assert [c.step for c in list_checkpoints(root)] == [1]


def test_a_slow_background_write_that_makes_progress_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    pub = _bounded_publisher(root, monkeypatch, sync_timeout_s=1.0)
    real = checkpoint_writer.write_all

    def slow(fd: int, data: Any) -> None:
        time.sleep(0.3)  # past the job's bound in all, but never 1 s without a byte written
        real(fd, data)

    monkeypatch.setattr(checkpoint_writer, "write_all", slow)
    pub.publish_in_background(1, [(f"w{i}", torch.full((4,), float(i))) for i in range(12)])
    t0 = time.monotonic()
    pub.join()
    assert time.monotonic() - t0 > 3.0  # (longer than the bound: ~2 s)
    pub.close()
    assert [c.step for c in list_checkpoints(root)] == [1]


def test_a_background_sync_past_its_bound_while_it_waits_for_replicas_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its write has ended, a job writes nothing while it waits for the replicas (and prunes):
    bounded on their own, those phases say nothing of a blocked write, however long they take."""
    root = tmp_path / "root"
    pub = _bounded_publisher(root, monkeypatch, sync_timeout_s=1.0)

    class SlowReplicas(NoWaiter):
        def wait(self, version: int, timeout_s: float) -> list[Any]:
            time.sleep(3.0)  # past the job's ~2 s bound, and 1 s without a byte written, three times
            return []

    pub.waiter = SlowReplicas()
    pub.publish_in_background(1, [("w", torch.ones(4))])
    pub.join()  # used to raise RootUnresponsive: "has written nothing for 1 s"
    pub.close()
    assert [c.step for c in list_checkpoints(root)] == [1]


# --- the weight iterator drawn to its end ----------------------------------------------------


def test_the_weights_are_drawn_to_their_end_when_the_root_is_gone_before_the_write(tmp_path: Path) -> None:
    root = tmp_path / "root"
    pub = _publisher(root)
    drawn: list[int] = []

    def gather() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(5):
            drawn.append(i)  # a collective gather: every rank draws every tensor
            yield f"w{i}", torch.ones(4)

    root.rmdir()
    with pytest.raises(FileNotFoundError, match="is gone"):
        pub.publish_and_wait(1, gather())
    assert drawn == [0, 1, 2, 3, 4]


# --- what holds a step's name ----------------------------------------------------------------


def test_a_step_name_held_by_something_else_is_not_called_published(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / step_dir_name(1)).mkdir()  # an empty folder someone made
    (root / step_dir_name(2)).symlink_to(tmp_path)  # a link to a folder
    publish_checkpoint(tmp_path / "elsewhere", 1, [("w", torch.ones(2))], config=CONFIG)
    (root / step_dir_name(3)).symlink_to(tmp_path / "elsewhere" / step_dir_name(1))  # to a checkpoint even
    for step in (1, 2, 3):
        with pytest.raises(FileExistsError, match="taken by something that is not a checkpoint"):
            publish_checkpoint(root, step, [("w", torch.ones(2))], config=CONFIG)
    publish_checkpoint(root, 4, [("w", torch.ones(2))], config=CONFIG)
    with pytest.raises(FileExistsError, match="already published"):
        publish_checkpoint(root, 4, [("w", torch.ones(2))], config=CONFIG)
    assert json.loads((root / step_dir_name(4) / "manifest.json").read_text())["step"] == 4


def test_a_slow_removal_of_an_old_step_does_not_fail_the_next_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing an old step's files can outlast the sync's bound (a million stray files on NFS, a
    mount that hangs): inside a look at the root it made the next sync find the root "not
    answering", and training ended. The step leaves the root's view at once; its files are removed
    on a thread of their own. (The removal is held on an event: a hang, deterministically.)"""
    release = threading.Event()
    removing = threading.Event()
    real_remove_tree = checkpoint_retention.remove_tree

    def hung_remove_tree(path: Path) -> None:
        removing.set()
        release.wait(60)
        real_remove_tree(path)

    monkeypatch.setattr(checkpoint_retention, "remove_tree", hung_remove_tree)
    root = tmp_path / "root"
    publisher = _publisher(root, keep=1, sync_timeout_s=0.05)
    publisher.publish_and_wait(publisher.next_version(), Model().tensors())
    publisher.publish_and_wait(publisher.next_version(), Model().tensors())  # deletes step 1
    assert removing.wait(10) and not (root / step_dir_name(1)).exists()
    time.sleep(1.5)  # past any bound a look at the root waits for an earlier one
    assert publisher.next_version() == 3  # the root answers, whatever the removal is at
    publisher.publish_and_wait(3, Model().tensors())  # and the next publish (its own prune) goes on
    release.set()
    deadline = time.monotonic() + 30
    while [p for p in root.iterdir() if p.name.startswith(".tmp-deleting-")]:
        assert time.monotonic() < deadline, "the deleted steps' files were never removed"
        time.sleep(0.1)


def test_a_slow_gather_in_the_foreground_is_no_write_blocked_in_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's idle time waiting for the caller's gather counted as "nothing written": once the
    gather outlasted the job's bound, the first slow write(2) ended the run with RootUnresponsive."""
    monkeypatch.setattr(checkpoint_publisher, "JOIN_POLL_S", 0.05)
    pub = _bounded_publisher(tmp_path / "root", monkeypatch, sync_timeout_s=1.0)
    monkeypatch.setattr(checkpoint_publisher, "JOIN_POLL_S", 0.05)
    real = checkpoint_writer.write_all
    monkeypatch.setattr(checkpoint_writer, "write_all", lambda fd, data: (time.sleep(0.3), real(fd, data)))
    pub.max_shard_bytes = 4096

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        time.sleep(2.5)  # a slow ZeRO-3 gather: past the job's bound before the first byte
        for i in range(8):
            yield f"w{i}", torch.full((1024,), float(i))

    pub.publish_and_wait(1, gathered())
    assert [c.step for c in list_checkpoints(tmp_path / "root")] == [1]
    pub.close()


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: ``_thread.interrupt_main`` calls
    whatever handler is installed, and code tested earlier in the session may have left another."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _SlowReplicas(NoWaiter):
    """Replicas that take 8 s to load each version (``sync_timeout`` is 600 s)."""

    def wait(self, version: int, timeout_s: float) -> list:
        time.sleep(8)
        return []


def _slow_replicas_publisher(root: Path) -> CheckpointPublisher:
    return CheckpointPublisher(
        root,
        _SlowReplicas(),
        config=CONFIG,
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=None,
        sync_timeout_s=600,
        heartbeat_max_age_s=60,
    )


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_during_a_foreground_replica_wait_does_not_hold_up_close(tmp_path: Path) -> None:
    """The job runs on a thread of its own: after Ctrl-C, close() (which train() calls) waited out
    the whole replica wait (sync_timeout, 600 s by default) of a sync the user gave up on."""
    import _thread

    pub = _slow_replicas_publisher(tmp_path / "root")
    threading.Timer(1.0, _thread.interrupt_main).start()  # the user's Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        pub.publish_and_wait(1, [("w", torch.ones(4))])
    t0 = time.monotonic()
    pub.close()  # raises nothing of the abandoned sync either
    assert time.monotonic() - t0 < 3
    assert [c.step for c in list_checkpoints(tmp_path / "root")] == [1]  # its write had ended


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_while_the_weights_are_drawn_publishes_nothing_and_close_says_nothing(tmp_path: Path, monkeypatch):
    import _thread

    pub = _bounded_publisher(tmp_path / "root", monkeypatch, sync_timeout_s=5.0)

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w0", torch.ones(4)
        _thread.interrupt_main()
        time.sleep(0.5)
        yield "w1", torch.ones(4)

    with pytest.raises(KeyboardInterrupt):
        pub.publish_and_wait(1, gathered())
    pub.close()
    assert list_checkpoints(tmp_path / "root") == []
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith(("step-", ".tmp-step"))]


@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize("how", ["publish_and_wait", "publish_in_background", "raise_if_failed"])
def test_the_next_sync_after_ctrl_c_is_not_failed_by_the_interrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``raise_if_failed`` (the next sync's and generate's first call) raised the interrupted
    job's "given up" as "the background checkpoint sync failed": after Ctrl-C in ``evaluate()``,
    which does not close the publisher, the next ``train()`` failed at its first sync."""
    import _thread

    pub = _bounded_publisher(tmp_path / "root", monkeypatch, sync_timeout_s=5.0)

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w0", torch.ones(4)
        _thread.interrupt_main()
        time.sleep(0.5)
        yield "w1", torch.ones(4)

    with pytest.raises(KeyboardInterrupt):
        pub.publish_and_wait(pub.next_version(), gathered())
    time.sleep(1.0)  # the job sees the weights stop coming, and fails
    version = pub.next_version()
    if how == "publish_and_wait":
        pub.publish_and_wait(version, [("w0", torch.ones(4)), ("w1", torch.ones(4))])
    elif how == "publish_in_background":
        pub.publish_in_background(version, [("w0", torch.ones(4)), ("w1", torch.ones(4))])
        pub.join()
    else:  # StaleRetryPolicy.generate's first call
        pub.raise_if_failed()
    if how != "raise_if_failed":
        assert [c.step for c in list_checkpoints(tmp_path / "root")] == [version]
    pub.close()


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_while_close_waits_for_a_background_sync_waits_no_more(tmp_path: Path) -> None:
    """A second Ctrl-C while ``close()`` waited for a background sync left ``close`` waiting for
    the worker without a bound (``shutdown(wait=True)``), as long as its replica wait took."""
    import _thread

    pub = _slow_replicas_publisher(tmp_path / "root")
    pub.publish_in_background(1, [("w", torch.ones(4))])
    threading.Timer(1.0, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pub.close()
    assert time.monotonic() - t0 < 4
