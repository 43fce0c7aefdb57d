"""The rebuild's streamed delta read and its in-order hashing, without SGLang.

A rebuild starts on a delta file's first frames while the rest of the file is still being
read, and hashes each part as it is written (``rollout_service.ordered_digests``) instead of
reading the new file back. What must survive that: a delta file damaged anywhere is refused
by its own size and digest, even where its early frames were already applied; nothing half
made appears under a final name; a part that fails stops the parts waiting behind it instead
of leaving them waiting; and digests fed from threads in any order equal one serial pass.
"""

from __future__ import annotations

import json
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both, stage_through
from rollout_service import checkpoint_format, delta_apply, delta_codec
from rollout_service.checkpoint_format import MANIFEST_NAME, CheckpointError, Manifest, step_dir_name
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.digest import file_digest
from rollout_service.ordered_digests import Abandoned, OrderedDigests
from rollout_service.sidecar.staging import Stage
from rollout_service.untrusted_files import Deadline

FRAME = 4 << 10  # small frames: a 64 KB tensor is 16 parts, so many parts are in flight at once


# --- OrderedDigests --------------------------------------------------------------------------


def _serial(prefix: bytes, tensors: list[list[bytes]]) -> tuple[str, list[str]]:
    whole = xxhash.xxh3_128(prefix + b"".join(b"".join(parts) for parts in tensors)).hexdigest()
    return f"xxh3_128:{whole}", [f"xxh3_128:{xxhash.xxh3_128(b''.join(p)).hexdigest()}" for p in tensors]


def test_digests_fed_from_threads_in_any_order_equal_one_serial_pass() -> None:
    rng = random.Random(7)
    # Tensors of 3, 0 (no bytes), 1 and 5 parts, parts of uneven sizes.
    tensors = [[rng.randbytes(rng.randint(1, 3000)) for _ in range(n)] for n in (3, 0, 1, 5)]
    prefix = rng.randbytes(40)
    part_tensors = [i for i, parts in enumerate(tensors) for _ in parts]
    flat = [p for parts in tensors for p in parts]
    digests = OrderedDigests(prefix, part_tensors, len(tensors))
    errors: list[BaseException] = []

    def feed(i: int) -> None:
        try:
            time.sleep(rng.random() / 50)
            digests.feed(i, memoryview(flat[i]), Deadline(30), f"part {i}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(i,)) for i in reversed(range(len(flat)))]
    for t in threads:  # the last parts start first: they must wait their turn
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    file_digest_, tensor_digests = digests.result()
    expected = _serial(prefix, tensors)
    assert (file_digest_, tensor_digests) == expected
    assert tensor_digests[1] == f"xxh3_128:{xxhash.xxh3_128(b'').hexdigest()}"  # no parts: the digest of nothing


@pytest.mark.parametrize("seed", range(5))
def test_parts_offered_from_threads_in_any_order_equal_one_serial_pass_and_never_wait(seed: int) -> None:
    """offer() returns at once whatever the order; whoever finds the next part ready hashes the
    run, and result() finishes what a caller may still be hashing."""
    rng = random.Random(seed)
    tensors = [[rng.randbytes(rng.randint(1, 200_000)) for _ in range(n)] for n in (7, 0, 1, 30, 2)]
    prefix = rng.randbytes(40)
    part_tensors = [i for i, parts in enumerate(tensors) for _ in parts]
    flat = [p for parts in tensors for p in parts]
    digests = OrderedDigests(prefix, part_tensors, len(tensors))
    order = list(range(len(flat)))
    rng.shuffle(order)
    queue = list(order)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                digests.offer(i, memoryview(flat[i]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert digests.result() == _serial(prefix, tensors)


def test_a_part_never_offered_leaves_the_digests_unfinished() -> None:
    digests = OrderedDigests(b"p", [0, 0, 1], 2)
    digests.offer(0, memoryview(b"a"))
    digests.offer(2, memoryview(b"c"))  # part 1 never comes (its encode failed)
    with pytest.raises(RuntimeError, match="only 1 of 3 parts"):
        digests.result()


def test_a_failed_part_wakes_the_parts_waiting_behind_it() -> None:
    digests = OrderedDigests(b"", [0, 0, 0], 1)
    outcome: list[BaseException] = []

    def later_part() -> None:
        try:
            digests.feed(2, memoryview(b"x"), Deadline(60), "part 2")
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=later_part)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()  # part 0 has not been fed: part 2 waits
    digests.abandon()  # part 0 failed
    waiter.join(10)
    assert not waiter.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Abandoned)
    with pytest.raises(RuntimeError, match="0 of 3 parts"):
        digests.result()


def test_a_part_waiting_past_the_deadline_gives_up_with_a_reason() -> None:
    digests = OrderedDigests(b"", [0, 0], 1)
    with pytest.raises(CheckpointError) as info:
        digests.feed(1, memoryview(b"x"), Deadline(0.05), "part 1")
    assert info.value.reason == "validation_timeout" and "part 1" in str(info.value)


# --- the streamed rebuild --------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path: Path, monkeypatch):
    """Steps 1 (full) to 3 (deltas) of a model with 4 KiB frames, and their full twins; the
    rebuild runs on two threads so that parts wait on each other."""
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", FRAME)
    monkeypatch.setattr(checkpoint_format, "MIN_FRAME_BYTES", FRAME)  # (readers refuse them)
    monkeypatch.setattr(delta_apply, "APPLY_THREADS", 2)
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-4, shapes={"embed": (512, 64), "mlp": (256, 64), "norm": (64,)})
    writer = DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3):
        publish_both(writer, root, full_root, step, model, max_shard_bytes=1 << 30)
        model.step()
    manifest = Manifest.load(root / step_dir_name(3))
    assert manifest.kind == "delta" and manifest.delta is not None
    assert len(manifest.delta.tensors["embed"].frames or []) == 16
    return root, full_root


def _stage_to(tmp_path: Path, root: Path, step: int) -> Stage:
    """A stage serving ``step - 1``, ready to apply ``step``."""
    stage = Stage(tmp_path / "stage")
    stage_through(stage, root, step - 1)
    return stage


def _delta_file(root: Path, step: int) -> Path:
    (path,) = (root / step_dir_name(step)).glob("delta-*.safetensors")
    return path


def _first_frame_at(path: Path) -> int:
    """Where the first blob's first frame starts in a delta file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    return 8 + length + min(e["data_offsets"][0] for e in header.values())


def _no_final_copy(stage: Stage, step: int) -> bool:
    return not [p for p in stage.path.iterdir() if p.name.startswith(step_dir_name(step))]


def test_the_streamed_rebuild_on_many_parts_and_two_threads_is_exact(tmp_path: Path, chain) -> None:
    root, full_root = chain
    stage = _stage_to(tmp_path, root, 3)
    try:
        built = stage.build(root, root / step_dir_name(3), Manifest.load(root / step_dir_name(3)), Deadline(60))
        assert_same_files(built.path, full_root / step_dir_name(3))
    finally:
        stage.close()


@pytest.mark.parametrize(
    "damage,reasons",
    [
        # A flipped bit in the first frame: that part is rebuilt before the file's end is read,
        # so only the file's own digest (checked before any result counts) can refuse it.
        ("flip_first_frame", {"digest_mismatch"}),
        ("flip_middle", {"digest_mismatch"}),
        ("flip_last_byte", {"digest_mismatch"}),
        ("flip_header", {"digest_mismatch", "delta_corrupt"}),
        ("cut_in_the_middle", {"truncated"}),
        ("append", {"size_mismatch"}),
    ],
)
def test_a_delta_file_damaged_anywhere_is_refused_and_nothing_is_left(
    tmp_path: Path, chain, damage: str, reasons: set[str]
) -> None:
    root, _ = chain
    stage = _stage_to(tmp_path, root, 3)
    path = _delta_file(root, 3)
    data = bytearray(path.read_bytes())
    at = {
        "flip_first_frame": _first_frame_at(path) + 5,
        "flip_middle": len(data) // 2,
        "flip_last_byte": len(data) - 1,
        "flip_header": 20,
    }.get(damage)
    if at is not None:
        data[at] ^= 0x10
    elif damage == "cut_in_the_middle":
        del data[len(data) // 2 :]
    else:
        data += b"\0" * 100
    path.write_bytes(bytes(data))
    try:
        with pytest.raises(CheckpointError) as info:
            stage.build(root, root / step_dir_name(3), Manifest.load(root / step_dir_name(3)), Deadline(60))
        assert info.value.reason in reasons, info.value
        assert path.name in str(info.value)  # refused as a damaged delta file, not only by what it rebuilt
        assert _no_final_copy(stage, 3)
    finally:
        stage.close()


def test_a_part_that_fails_early_stops_the_parts_waiting_behind_it(tmp_path: Path, chain) -> None:
    """The first frame is not zstd, and the manifest vouches for the damaged file (its digest
    matches): the first part fails, and the fifteen behind it must stop, not wait it out."""
    root, _ = chain
    stage = _stage_to(tmp_path, root, 3)
    path = _delta_file(root, 3)
    data = bytearray(path.read_bytes())
    at = _first_frame_at(path)
    data[at : at + 4] = b"\0\0\0\0"  # the zstd magic number
    path.write_bytes(bytes(data))
    step_dir = root / step_dir_name(3)
    doc = json.loads((step_dir / MANIFEST_NAME).read_text())
    doc["files"][path.name]["digest"] = file_digest(path)
    (step_dir / MANIFEST_NAME).write_text(json.dumps(doc))
    outcome: list[BaseException] = []

    def build() -> None:
        try:
            stage.build(root, step_dir, Manifest.load(step_dir), Deadline(120))
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=build)
    runner.start()
    runner.join(60)  # a rebuild whose waiting parts were never woken would sit here until its deadline
    try:
        assert not runner.is_alive(), "the rebuild hung after its first part failed"
        assert len(outcome) == 1 and isinstance(outcome[0], CheckpointError), outcome
        assert outcome[0].reason == "delta_corrupt" and "not a zstd frame" in str(outcome[0])
        assert _no_final_copy(stage, 3)
    finally:
        runner.join()
        stage.close()


def test_a_later_part_that_fails_is_the_reason_given_not_the_earlier_parts_it_stopped(
    tmp_path: Path, monkeypatch
) -> None:
    """A NaN in the last part of a tensor fails that part while the first part is still at
    work: the first part then stops (Abandoned), and the reason given is the NaN."""
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", FRAME)
    monkeypatch.setattr(checkpoint_format, "MIN_FRAME_BYTES", FRAME)  # (readers refuse them)
    monkeypatch.setattr(delta_apply, "APPLY_THREADS", 2)
    root = tmp_path / "root"
    model = Model(lr=1e-4, shapes={"embed": (512, 64), "norm": (64,)})
    writer = DeltaCheckpointWriter(full_every=100, check_finite=False)
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    model.step()
    with torch.no_grad():
        model.params["embed"][-1, -1] = float("nan")  # the last of its 16 parts
    assert writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "delta"
    stage = _stage_to(tmp_path, root, 2)
    slow_read = delta_apply._pread_into

    def first_part_slow(fd: int, view: memoryview, offset: int, where: str) -> None:
        if offset < 4096:  # the first part's first slice
            time.sleep(0.5)
        slow_read(fd, view, offset, where)

    monkeypatch.setattr(delta_apply, "_pread_into", first_part_slow)
    two = root / step_dir_name(2)
    try:
        with pytest.raises(CheckpointError) as info:
            stage.build(root, two, Manifest.load(two), Deadline(60), check_finite=True)
        assert info.value.reason == "non_finite" and "embed" in str(info.value), info.value
        assert _no_final_copy(stage, 2)
    finally:
        stage.close()


def test_once_a_part_fails_no_more_parts_start(tmp_path: Path, monkeypatch) -> None:
    """Parts are submitted through a bounded window, and none after one failed: a delta of many
    small frames, bad at its first, costs a window of parts, not one job per part of the shard."""
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", FRAME)
    monkeypatch.setattr(checkpoint_format, "MIN_FRAME_BYTES", FRAME)  # (readers refuse them)
    root = tmp_path / "root"
    model = Model(lr=1e-4, shapes={"embed": (1024, 64), "norm": (64,)})  # 32 parts of 4 KiB
    writer = DeltaCheckpointWriter(full_every=100, check_finite=False)
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    model.step()
    with torch.no_grad():
        model.params["embed"][0, 0] = float("nan")  # in the first part
    assert writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "delta"
    stage = _stage_to(tmp_path, root, 2)
    started: list[int] = []
    real = delta_apply._rebuild_part
    monkeypatch.setattr(delta_apply, "_rebuild_part", lambda *a: started.append(a[-1]) or real(*a))
    monkeypatch.setattr(delta_apply, "IN_FLIGHT_PARTS", 2)
    two = root / step_dir_name(2)
    try:
        with pytest.raises(CheckpointError) as info:
            stage.build(root, two, Manifest.load(two), Deadline(60), check_finite=True)
        assert info.value.reason == "non_finite" and "embed" in str(info.value), info.value
        assert len(started) <= 3, started  # of 33 parts
        assert _no_final_copy(stage, 2)
    finally:
        stage.close()
