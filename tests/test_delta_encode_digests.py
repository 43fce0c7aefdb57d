"""The delta writer's encode threads: each part hashed where it was encoded, and no frame for
a part that did not change (no SGLang here).

A delta's manifest carries the digest of every tensor and every shard a full publish of the
same weights would write. The encode threads hand each part of the held copy to the hashers as
soon as it is updated, and the parts are hashed in file order, so the write reads nothing back;
these tests hold those digests to what a full publish writes, across parts and shards, and
check that a failing part neither hangs the other threads nor hides its own error. An unchanged
part is found without a scan of every changed part's XOR (only a frame small enough to be all
zeros is checked); the last test holds that to "no frame exactly when nothing changed".
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both, stage_through
from rollout_service import delta_codec, delta_writer
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar.staging import Stage

# 18.9 MB in bf16 (two parts: a full 16 MiB one and a partial one), then smaller tensors; with
# 20 MB shards the big tensor fills the first shard and the rest share the second.
SHAPES = {"embed": (4096, 2304), "layer.q": (64, 64), "layer.mlp": (1500, 1000), "empty": (0,), "norm": (64,)}
SHARD = 20_000_000


def _no_read_back(monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("the write hashed the held copy again")

    monkeypatch.setattr(delta_writer, "_hash_held", refuse)


def test_encode_threads_hash_every_part_and_shard_as_a_full_publish_writes(tmp_path: Path, monkeypatch) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-3, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100, threads=3)
    publish_both(writer, root, full_root, 1, model, max_shard_bytes=SHARD)
    _no_read_back(monkeypatch)  # from here on, every version is a delta hashed while encoded
    for step in (2, 3, 4):
        model.step()
        result, reference = publish_both(writer, root, full_root, step, model, max_shard_bytes=SHARD)
        assert result.kind == "delta"
        delta = Manifest.load(root / step_dir_name(step)).delta
        full = Manifest.load(full_root / step_dir_name(step))
        assert delta is not None and len(delta.target_files) == len(full.files) == 4  # 2 shards, index, config
        assert {n: e.digest for n, e in delta.target_files.items()} == {n: e.digest for n, e in full.files.items()}
        assert delta.tensors["embed"].frames is not None and len(delta.tensors["embed"].frames) == 2
    stage = Stage(tmp_path / "stage")
    try:
        built = stage_through(stage, root, 4)
        assert built is not None
        assert_same_files(built.path, full_root / step_dir_name(4))
    finally:
        stage.close()


def test_a_write_with_other_shards_than_the_encode_hashed_hashes_the_copy(tmp_path: Path) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-3, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100)
    publish_both(writer, root, full_root, 1, model, max_shard_bytes=SHARD)  # the base: two shards
    model.step()
    writer.absorb(model.tensors(), dtype="bfloat16", max_shard_bytes=1 << 30)  # hashed for one shard
    result = writer.write(root, 2, config=CONFIG, max_shard_bytes=SHARD, run_id=RUN)  # written as two
    assert result.kind == "delta"
    publish_checkpoint(
        full_root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
    )
    delta = Manifest.load(root / step_dir_name(2)).delta
    full = Manifest.load(full_root / step_dir_name(2))
    assert delta is not None
    assert {n: e.digest for n, e in delta.target_files.items()} == {n: e.digest for n, e in full.files.items()}


def test_a_failing_part_raises_its_own_error_and_no_thread_waits_forever(tmp_path: Path, monkeypatch) -> None:
    """The third part fails: the parts behind it are never hashed (their turn never comes), and
    nothing waits for them; the error the caller sees is the part's, and the next version is
    published in full."""
    root = tmp_path / "root"
    model = Model(lr=1e-3, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100, threads=2)
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    real = delta_codec.encode_frame
    calls = []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("part 3 could not be encoded")
        return real(*args, **kwargs)

    monkeypatch.setattr(delta_codec, "encode_frame", fail_third)
    model.step()
    with pytest.raises(MemoryError, match="part 3"):
        writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    monkeypatch.undo()
    model.step()
    result = writer.publish(
        root, 3, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
    )
    assert result.kind == "full"  # the held copy was half updated: nothing can apply a delta to it
    model.step()
    assert (
        writer.publish(
            root, 4, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
        ).kind
        == "delta"
    )


def test_a_layout_change_mid_version_publishes_in_full_without_waiting(tmp_path: Path) -> None:
    """Parts submitted before the layout changed still take their turns; the version is full."""
    root = tmp_path / "root"
    model = Model(lr=1e-3, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100, threads=2)
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    model.step()
    tensors = model.tensors()
    name, t = tensors[2]
    tensors[2] = (name, t[:-1])  # a shape changes after the big tensor's two parts were queued
    result = writer.publish(root, 2, tensors, config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    assert result.kind == "full"
    assert "layout changed" in writer.last.why_full


@pytest.mark.parametrize("n", [1, 7, 4096, 131_073, delta_codec.CHUNK_BYTES])
def test_a_frame_is_none_exactly_when_the_part_did_not_change(n: int) -> None:
    """The XOR is scanned for a change only when its frame is small enough to be all zeros: an
    unchanged part of any size still has no frame, and one changed byte anywhere is kept."""
    rng = np.random.default_rng(n)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    scratch = delta_codec.new_scratch()
    compressor = delta_codec.new_compressor()
    assert delta_codec.encode_frame(base.copy(), base, scratch, compressor) is None
    for at in {0, n // 2, n - 1}:
        new = base.copy()
        new[at] ^= 0x10
        frame = delta_codec.encode_frame(new, base, scratch, compressor)
        assert frame is not None
        rebuilt = base.copy()
        with delta_codec.FrameReader(frame, n, where="test") as reader:
            reader.xor_into(rebuilt, delta_codec.new_scratch(n))
            reader.finish()
        assert np.array_equal(rebuilt, new)


@pytest.mark.parametrize("dtype,lr", [("bfloat16", 1e-3), ("float16", 1e-5)])
def test_tensors_in_the_checkpoint_dtype_are_read_in_place_and_never_held(
    tmp_path: Path, monkeypatch, dtype: str, lr: float
) -> None:
    """A CPU tensor already in the checkpoint dtype (bf16 or fp16; one of them not contiguous) is
    encoded from its own bytes (no copy into the thread's buffer first): its deltas are byte for
    byte those made from the fp32 weights, and the held copy never shares its memory, so a
    trainer that reuses the buffer after a publish (here: fills it with NaN) changes nothing
    that was published or that the next delta is taken against."""
    in_place: list[int] = []
    read_where_it_is = delta_writer._bytes_of

    def spy(t):
        if threading.current_thread().name.startswith("delta-encode"):
            in_place.append(t.numel())
        return read_where_it_is(t)

    monkeypatch.setattr(delta_writer, "_bytes_of", spy)
    model = Model(lr=lr, shapes=SHAPES)

    def laid_out(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.t() if name == "layer.q" else t  # a transposed view: not contiguous

    fp32 = lambda: [(k, laid_out(k, p.detach())) for k, p in model.params.items()]  # noqa: E731
    roots = {"in_dtype": tmp_path / "in_dtype", "fp32": tmp_path / "fp32"}
    writers = {k: DeltaCheckpointWriter(full_every=100, threads=3) for k in roots}
    for step in (1, 2, 3):
        if step > 1:
            model.step()
        handed = [(k, t.to(getattr(torch, dtype))) for k, t in fp32()]
        in_place.clear()
        kinds = {
            k: writers[k]
            .publish(
                roots[k],
                step,
                handed if k == "in_dtype" else fp32(),
                config=CONFIG,
                dtype=dtype,
                max_shard_bytes=SHARD,
                run_id=RUN,
            )
            .kind
            for k in roots
        }
        publish_checkpoint(
            tmp_path / "full", step, fp32(), config=CONFIG, dtype=dtype, max_shard_bytes=SHARD, run_id=RUN
        )
        for _, t in handed:
            t.fill_(float("nan"))
        if step == 1:
            continue
        assert kinds == {"in_dtype": "delta", "fp32": "delta"}
        assert sum(in_place) == sum(int(np.prod(s)) for s in SHAPES.values())  # every part read in place
        made = {k: Manifest.load(roots[k] / step_dir_name(step)) for k in roots}
        assert {n: e.digest for n, e in made["in_dtype"].files.items() if n.startswith("delta-")} == {
            n: e.digest for n, e in made["fp32"].files.items() if n.startswith("delta-")
        }
    stage = Stage(tmp_path / "stage")
    try:
        built = stage_through(stage, roots["in_dtype"], 3)
        assert built is not None
        assert_same_files(built.path, tmp_path / "full" / step_dir_name(3))
    finally:
        stage.close()
