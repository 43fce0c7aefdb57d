"""Delta checkpoints without SGLang: the writer's full/delta decisions, bit-exact rebuilds,
corrupt or missing links, retention of chains, the stage's chain replay, and kills mid-apply (20 random moments)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both
from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints, validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_apply import materialize
from rollout_service.delta_choice import PublishCosts
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar.staging import Stage
from rollout_service.untrusted_files import Deadline
from trainer_hooks.checkpoint_retention import prune_checkpoints


def test_25_delta_versions_rebuild_bit_for_bit_what_a_full_publish_writes(tmp_path: Path) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6)
    writer = DeltaCheckpointWriter(full_every=10)
    kinds = []
    for step in range(1, 26):
        result, reference = publish_both(writer, root, full_root, step, model)
        kinds.append(result.kind)
        manifest = Manifest.load(result.path)
        ref = Manifest.load(reference.path)
        if manifest.kind == "delta":
            assert {k: e.digest for k, e in manifest.delta.target_files.items()} == {
                k: e.digest for k, e in ref.files.items()
            }
            assert result.total_bytes < 0.5 * ref.total_bytes
            validate_checkpoint(result.path, check_digests=True)
        out = tmp_path / "mat" / str(step)
        rebuilt = materialize(root, step, out)
        assert rebuilt.kind == "full" and rebuilt.source_fingerprint() == manifest.fingerprint()
        assert_same_files(out, reference.path)
        validate_checkpoint(out, check_digests=True, check_finite=True)
        model.step()
    # The first version and every 10th after it are full (a chain: one full step + 9 deltas).
    assert [i + 1 for i, k in enumerate(kinds) if k == "full"] == [1, 11, 21]


def test_tensors_larger_than_a_chunk_are_encoded_in_place_bit_for_bit(tmp_path: Path) -> None:
    from rollout_service import delta_codec

    root, full_root = tmp_path / "root", tmp_path / "full"
    big = (4096, 2304)  # 18.9 MB in bf16: two encode chunks, the second one partial
    assert 1 < 2 * big[0] * big[1] / delta_codec.CHUNK_BYTES < 2
    model = Model(lr=1e-6, shapes={"embed": big, "norm": (64,), "odd": (3, 5)})
    writer = DeltaCheckpointWriter(full_every=100)
    held_before = None
    for step in range(1, 5):
        result, reference = publish_both(writer, root, full_root, step, model, max_shard_bytes=10 << 20)
        assert result.kind == ("full" if step == 1 else "delta")
        out = tmp_path / "mat" / str(step)
        materialize(root, step, out)
        assert_same_files(out, reference.path)
        held = writer._held["embed"].data
        if held_before is not None:
            assert held is held_before, "the held bytes are updated in place, not reallocated"
        held_before = held
        model.step()


def test_a_version_past_max_ratio_stops_holding_its_delta_while_encoding(tmp_path: Path, monkeypatch) -> None:
    # When most weights change, the compressed XORs would be close to a second model copy in RAM:
    # the encode stops holding them once they pass max_ratio of the full size, and the version is
    # written in full. The held copy is still the new version's: the next delta applies to it.
    from rollout_service import delta_codec

    encoded: list[int] = []
    real = delta_codec.encode_frame

    def counting(*args, **kwargs):
        encoded.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(delta_codec, "encode_frame", counting)
    root, full_root = tmp_path / "root", tmp_path / "full"
    writer = DeltaCheckpointWriter(full_every=100, max_ratio=0.05, threads=1)
    model = Model(lr=1e-2)  # every weight changes
    assert publish_both(writer, root, full_root, 1, model)[0].kind == "full"
    model.step()
    encoded.clear()
    assert publish_both(writer, root, full_root, 2, model)[0].kind == "full"
    assert "while encoding" in writer.last.why_full and "0.05" in writer.last.why_full, writer.last.why_full
    tensors = len(model.tensors())
    assert len(encoded) <= 3 < tensors, f"{len(encoded)} of {tensors} tensors encoded after the budget was passed"
    assert_same_files(root / step_dir_name(2), full_root / step_dir_name(2))
    model.opt.param_groups[0]["lr"] = 1e-6  # a small step: a delta on the version written in full
    model.step()
    assert publish_both(writer, root, full_root, 3, model)[0].kind == "delta"
    materialize(root, 3, tmp_path / "out3")
    assert_same_files(tmp_path / "out3", full_root / step_dir_name(3))


def test_a_refused_version_past_max_ratio_still_leaves_the_next_version_a_delta(tmp_path: Path) -> None:
    # A version refused for NaN whose in-flight encodes then passed max_ratio switched to full and
    # skipped the undo: the held copy was lost and the next, small, change was published in full.
    # (Refused only after it passed max_ratio, a version has dropped its frames: the next is full.)
    from rollout_service.checkpoint_writer import PublishRefused

    root = tmp_path / "root"
    writer = DeltaCheckpointWriter(full_every=100, max_ratio=0.05, threads=2)
    g = torch.Generator().manual_seed(0)
    v1 = {f"t{i}": torch.randn(256, 64, generator=g) for i in range(8)}

    def publish(step: int, state: dict) -> str:
        return writer.publish(root, step, list(state.items()), config=CONFIG, dtype="bfloat16", run_id=RUN).kind

    assert publish(1, v1) == "full"
    v2 = {k: v + torch.randn(v.shape, generator=g) for k, v in v1.items()}  # every weight changes
    v2["t0"][0, 0] = float("nan")  # refused at the first tensor, before the encodes pass max_ratio
    with pytest.raises(PublishRefused):
        publish(2, v2)
    v3 = {k: v.clone() for k, v in v1.items()}
    v3["t5"][0, :4] += 1.0
    assert publish(3, v3) == "delta", writer.last.why_full
    materialize(root, 3, tmp_path / "out3")
    full = tmp_path / "full"
    publish_checkpoint(full, 3, list(v3.items()), config=CONFIG, dtype="bfloat16", run_id=RUN)
    assert_same_files(tmp_path / "out3", full / step_dir_name(3))


def test_the_writer_falls_back_to_full_with_a_reason(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = Model()
    writer = DeltaCheckpointWriter(full_every=100, max_ratio=0.5)
    assert writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "full"
    model.step()
    assert writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "delta"
    # Names/shapes change (a resized embedding): full.
    resized = [(k, torch.zeros(600, 64) if k == "embed" else v) for k, v in model.tensors()]
    assert writer.publish(root, 3, resized, config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "full"
    assert "layout changed" in writer.last.why_full
    # Every weight changes a lot: the delta would be larger than half the full checkpoint.
    noisy = [(k, torch.randn(v.shape)) for k, v in resized]
    assert writer.publish(root, 4, noisy, config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "full"
    assert "checkpoint_delta_max_ratio" in writer.last.why_full
    # The base was republished by someone else: the delta would not apply to what is there.
    same = [(k, v + 1e-6) for k, v in noisy]
    (root / step_dir_name(4) / "manifest.json").write_text(
        Manifest.load(root / step_dir_name(4)).to_json().replace('"rollout-service"', '"other"')
    )
    assert writer.publish(root, 5, same, config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "full"
    assert "no longer published" in writer.last.why_full
    # A restarted trainer has nothing in memory: its first publish is full.
    fresh = DeltaCheckpointWriter()
    assert fresh.publish(root, 6, same, config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "full"


class ScriptedCosts(PublishCosts):
    """The real choice over scripted timings: each publish "took" ``rate[kind]`` s/GB (the
    writer's real timings on a 100 KB test model are noise)."""

    def __init__(self, probe_every: int):
        super().__init__(probe_every)
        self.rate = {"full": 1.0, "delta": 3.0}
        self.seen: list[str] = []

    def observe(self, kind: str, seconds: float, full_bytes: int) -> None:
        self.seen.append(kind)
        super().observe(kind, self.rate[kind] * full_bytes / 1e9, full_bytes)


def test_publish_costs_choose_the_faster_kind_and_probe_deltas_again() -> None:
    costs = PublishCosts(probe_every=3)
    assert costs.choose().delta  # nothing measured yet
    costs.observe("full", 1.0, 10**9)
    assert costs.choose().delta  # deltas not measured yet
    costs.observe("delta", 3.0, 10**9)
    choice = costs.choose()
    assert not choice.delta and "1.00 s/GB against 3.00 s/GB" in choice.reason and "every 3 versions" in choice.reason
    costs.observe("full", 1.0, 10**9)
    assert not costs.choose().delta
    costs.observe("full", 1.0, 10**9)
    choice = costs.choose()  # a delta, then 2 full ones: every 3rd version is a delta
    assert choice.delta and choice.probe
    costs.observe("delta", 0.2, 10**9)  # the storage got slower, or the host quieter
    assert costs.s_per_gb["delta"] == pytest.approx(1.6) and not costs.choose().delta  # averaged, still slower
    costs.observe("full", 1.0, 10**9)
    costs.observe("full", 1.0, 10**9)
    assert costs.choose().probe
    costs.observe("delta", 0.2, 10**9)
    assert costs.s_per_gb["delta"] == pytest.approx(0.9)
    choice = costs.choose()
    assert choice.delta and not choice.probe
    costs.observe("delta", 1.0, 0)  # nothing to divide by: ignored
    assert costs.s_per_gb["delta"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="probe_every"):
        PublishCosts(0)


def test_the_writer_publishes_full_while_full_is_faster_and_keeps_chains_exact(tmp_path: Path, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="rollout_service.delta_writer")
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6)
    costs = ScriptedCosts(probe_every=4)
    writer = DeltaCheckpointWriter(full_every=4, costs=costs)
    kinds = []
    for step in range(1, 15):
        if step == 9:
            costs.rate = {"full": 3.0, "delta": 1.0}  # from here deltas are the faster sync
        result, reference = publish_both(writer, root, full_root, step, model)
        kinds.append(result.kind)
        out = tmp_path / "mat" / str(step)
        materialize(root, step, out)
        assert_same_files(out, reference.path)
        model.step()
    # 1: no base; 2: deltas not measured yet; 3-5: full is faster; 6: a delta every 4 versions
    # measures deltas slower still; 7-9: full (the timings changed at 9, but only a delta measures
    # a delta); 10: the next such delta sees the new rate; 11-12: deltas; 13: the full step every
    # full_every (4) versions; 14: a delta.
    assert "".join(k[0].upper() for k in kinds) == "FDFFFDFFFDDDFD"
    assert costs.seen == kinds, "every publish is measured as the kind it was"
    lines = [r.getMessage() for r in caplog.records]
    faster = [m.split()[1] for m in lines if "full publishes are faster on this storage" in m]
    assert faster == ["3"], lines  # said once, not at every full version nor after each probe
    assert [m.split()[1] for m in lines if "deltas measure faster again" in m] == ["11"], lines
    assert any("step 13 published in full: a full checkpoint every 4 versions" in m for m in lines), lines


def test_a_delta_that_comes_out_too_large_counts_as_a_slow_delta(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = Model(lr=1e-2)  # every weight changes: no delta fits under max_ratio
    costs = ScriptedCosts(probe_every=2)
    writer = DeltaCheckpointWriter(full_every=100, max_ratio=0.01, costs=costs)
    reasons = []
    for step in range(1, 8):
        assert writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "full"
        reasons.append(writer.last.why_full)
        model.step()
    # Version 2 encoded a delta and wrote it in full: measured as a delta (its encode was paid
    # for), so the next deltas are tried only every 2 versions, not at every version.
    assert costs.seen == ["full", "delta", "full", "delta", "full", "delta", "full"]
    assert all("checkpoint_delta_max_ratio" in r for r in reasons[1::2]), reasons
    assert all("full publishes are faster" in r for r in reasons[2::2]), reasons


def test_a_failed_write_makes_the_next_publish_full(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "root"
    model = Model()
    writer = DeltaCheckpointWriter(full_every=100)
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    model.step()
    from rollout_service import delta_writer

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(delta_writer, "atomic_step_dir", boom)
    with pytest.raises(OSError):
        writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    monkeypatch.undo()
    model.step()
    result = writer.publish(root, 3, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    assert result.kind == "full"  # the held bytes were of version 2, which nobody can apply to


def test_writer_holds_one_copy_of_the_model(tmp_path: Path) -> None:
    model = Model()
    writer = DeltaCheckpointWriter()
    writer.publish(tmp_path, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    bf16_bytes = sum(p.numel() * 2 for p in model.params.values())
    assert writer.held_bytes == bf16_bytes


def _chain(tmp_path: Path, versions: int = 4, full_every: int = 100) -> tuple[Path, Path, Model]:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model()
    writer = DeltaCheckpointWriter(full_every=full_every)
    for step in range(1, versions + 1):
        publish_both(writer, root, full_root, step, model)
        model.step()
    return root, full_root, model


def _delta_file(root: Path, step: int) -> Path:
    return sorted((root / step_dir_name(step)).glob("delta-*.safetensors"))[0]


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("flip", "digest_mismatch"),
        ("truncate", "truncated"),
        ("remove", "missing_file"),
        ("remove_base", "broken_chain"),
        ("republish_base", "broken_chain"),
    ],
)
def test_a_damaged_link_is_rejected_with_a_reason(tmp_path: Path, damage: str, reason: str) -> None:
    root, _, _ = _chain(tmp_path)
    target = _delta_file(root, 3)
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[-3] ^= 0x40
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "remove":
        target.unlink()
    elif damage == "remove_base":
        os.rename(root / step_dir_name(2), root / ".tmp-gone")
    else:
        m = Manifest.load(root / step_dir_name(2))
        m.created_at += 1
        (root / step_dir_name(2) / "manifest.json").write_text(m.to_json())
    stage = Stage(tmp_path / "stage")
    step_dir = root / step_dir_name(3 if damage in ("flip", "truncate", "remove") else 4)
    try:
        with pytest.raises(CheckpointError) as info:
            stage.build(root, step_dir, Manifest.load(step_dir), Deadline(60))
        assert info.value.reason == reason, info.value
        # Nothing half-made is left under a final name.
        assert not [
            p
            for p in stage.path.iterdir()
            if p.name.startswith(step_dir_name(3)) or p.name.startswith(step_dir_name(4))
        ]
    finally:
        stage.close()


def test_the_stage_replays_a_chain_and_then_applies_one_delta_per_sync(tmp_path: Path) -> None:
    root, full_root, _ = _chain(tmp_path, versions=6)
    stage = Stage(tmp_path / "stage")
    try:
        late = stage.build(root, root / step_dir_name(4), Manifest.load(root / step_dir_name(4)), Deadline(60))
        assert late.kind == "delta" and late.chain_length == 3  # full step 1, then deltas 2, 3, 4
        assert_same_files(late.path, full_root / step_dir_name(4))
        assert late.bytes_read == sum(Manifest.load(root / step_dir_name(s)).total_bytes for s in (1, 2, 3, 4))
        # Only the rebuilt version stays: the intermediate ones were removed.
        assert sorted(p.name for p in stage.path.iterdir() if p.name.startswith("step-")) == [late.path.name]
        nxt = stage.build(root, root / step_dir_name(5), Manifest.load(root / step_dir_name(5)), Deadline(60))
        assert nxt.chain_length == 1 and nxt.bytes_read == Manifest.load(root / step_dir_name(5)).total_bytes
        assert_same_files(nxt.path, full_root / step_dir_name(5))
        # A damaged staged base is noticed (its digests are checked while it is read): the chain
        # is replayed from its full step instead.
        stage.prune({nxt.path})
        shard = sorted(nxt.path.glob("model*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
        six = stage.build(root, root / step_dir_name(6), Manifest.load(root / step_dir_name(6)), Deadline(60))
        assert six.chain_length == 5
        assert_same_files(six.path, full_root / step_dir_name(6))
    finally:
        stage.close()


@pytest.mark.parametrize("damage", ["zeroed header", "bad dtype tag", "cut short"])
def test_a_staged_base_damaged_where_the_delta_reads_first_is_replayed_not_rejected(
    tmp_path: Path, damage: str
) -> None:
    """A staged copy a host crash left damaged (zeroed blocks, unsynced; a cut file): the next delta
    fails on the base's header or layout before any digest, which is the base's fault, not the step's:
    the chain is replayed from its full step (a rejection would stop training at every later delta)."""
    root, full_root, _ = _chain(tmp_path, versions=4)
    stage = Stage(tmp_path / "stage")
    try:
        two = stage.build(root, root / step_dir_name(2), Manifest.load(root / step_dir_name(2)), Deadline(60))
        stage.prune({two.path})
        shard = sorted(two.path.glob("model*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        if damage == "zeroed header":
            data[:4096] = bytes(4096)
        elif damage == "bad dtype tag":
            at = data.index(b'"dtype":"') + len(b'"dtype":"')
            data[at : at + 2] = b"Q9"
        else:
            data = data[: len(data) // 2]
        shard.write_bytes(bytes(data))
        three = stage.build(root, root / step_dir_name(3), Manifest.load(root / step_dir_name(3)), Deadline(60))
        assert three.chain_length == 2  # replayed: full step 1, then deltas 2 and 3
        assert_same_files(three.path, full_root / step_dir_name(3))
        assert not two.path.exists()
    finally:
        stage.close()


def _build_each(stage_dir: Path, root: Path, steps: range) -> list[str]:
    """Stage ``steps`` one after the other; what each gave (its kind, or the reason it was refused)."""
    stage = Stage(stage_dir)
    outcomes = []
    try:
        for s in steps:
            path = root / step_dir_name(s)
            try:
                built = stage.build(root, path, Manifest.load(path), Deadline(60))
                stage.prune({built.path})
                outcomes.append(built.kind)
            except CheckpointError as exc:
                outcomes.append(exc.reason)
    finally:
        stage.close()
    return outcomes


def test_a_writer_given_no_run_id_keeps_its_chains_run_and_late_joiners_rebuild_it(tmp_path: Path) -> None:
    """Without a run id each publish drew a fresh one: every delta was another run's than its base,
    which a staged replica applied and a late joiner refused (two replicas, two answers)."""
    root, model, writer = tmp_path / "root", Model(), DeltaCheckpointWriter(full_every=100)
    for s in (1, 2, 3):
        model.step()
        assert writer.publish(root, s, model.tensors(), config=CONFIG, dtype="bfloat16").kind == (
            "full" if s == 1 else "delta"
        )
    assert len({Manifest.load(root / step_dir_name(s)).run_id for s in (1, 2, 3)}) == 1
    assert _build_each(tmp_path / "staged", root, range(1, 4)) == ["full", "delta", "delta"]
    assert _build_each(tmp_path / "late", root, range(3, 4)) == ["delta"]
    model.step()  # another run id given: a new chain
    assert writer.publish(root, 4, model.tensors(), config=CONFIG, dtype="bfloat16", run_id="other").kind == "full"
    assert "run id changed" in writer.last.why_full


def test_a_delta_on_a_base_of_another_run_is_refused_by_staged_and_late_replicas_alike(tmp_path: Path) -> None:
    root, full_root, _ = _chain(tmp_path, versions=3)
    staged = Stage(tmp_path / "stage")
    try:
        two = staged.build(root, root / step_dir_name(2), Manifest.load(root / step_dir_name(2)), Deadline(60))
        staged.prune({two.path})
        three = root / step_dir_name(3)
        manifest = Manifest.load(three)
        forged = manifest.__class__.from_json(manifest.to_json().replace(f'"{manifest.run_id}"', '"another-run"'))
        assert forged.run_id == "another-run"
        with pytest.raises(CheckpointError) as staged_answer:
            staged.build(root, three, forged, Deadline(60))
    finally:
        staged.close()
    assert staged_answer.value.reason == "broken_chain" and "different runs" in str(staged_answer.value)


def test_a_changed_shard_size_publishes_in_full_and_every_step_stays_rebuildable(tmp_path: Path) -> None:
    """A delta's target shards are planned by the new size, its base's by the old: such a delta
    could be rebuilt by no replica (delta_layout_mismatch), nor any delta chained on it."""
    root, model, writer = tmp_path / "root", Model(), DeltaCheckpointWriter(full_every=100)
    sizes = {1: 40_000, 2: 10**9, 3: 10**9}
    for s, size in sizes.items():
        model.step()
        writer.publish(root, s, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=size, run_id=RUN)
        if s == 2:
            assert writer.last.kind == "full" and "max_shard_bytes changed" in writer.last.why_full
    assert len(Manifest.load(root / step_dir_name(1)).files) > 2  # (sharded: the sizes really differ)
    assert _build_each(tmp_path / "stage", root, range(1, 4)) == ["full", "full", "delta"]


def test_retention_never_breaks_a_chain(tmp_path: Path) -> None:
    root, _, _ = _chain(tmp_path, versions=7, full_every=3)  # full 1, 4, 7; deltas 2-3, 5-6
    kinds = {c.step: Manifest.load(c.path).kind for c in list_checkpoints(root)}
    assert [s for s, k in kinds.items() if k == "full"] == [1, 4, 7]
    prune_checkpoints(root, keep=1, protected={6})  # a replica still serves 6
    assert [c.step for c in list_checkpoints(root)] == [4, 5, 6, 7]
    materialize(root, 6, tmp_path / "six")  # still rebuildable
    prune_checkpoints(root, keep=1)
    assert [c.step for c in list_checkpoints(root)] == [7]


def test_a_delta_without_a_stage_is_refused_by_validate_only_for_loading(tmp_path: Path) -> None:
    root, _, _ = _chain(tmp_path, versions=2)
    report = validate_checkpoint(root / step_dir_name(2), check_digests=True)
    assert report.manifest.kind == "delta" and "delta files hold the blobs the manifest names" in report.checks
    # A blob renamed to a tensor the manifest does not assign to that file is refused.
    manifest = Manifest.load(root / step_dir_name(2))
    files = [t.delta_file for t in manifest.delta.tensors.values() if t.delta_file]
    # (One of a file's several tensors: a file no tensor names is refused as bad_manifest first.)
    name = next(n for n, t in manifest.delta.tensors.items() if t.delta_file and files.count(t.delta_file) > 1)
    manifest.delta.tensors[name].delta_file = None
    (root / step_dir_name(2) / "manifest.json").write_text(manifest.to_json())
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(root / step_dir_name(2))
    assert info.value.reason == "delta_corrupt"


def test_cli_validate_and_materialize(tmp_path: Path) -> None:
    root, full_root, _ = _chain(tmp_path, versions=3)
    cli = [sys.executable, "-m", "rollout_service.cli"]
    out = subprocess.run(
        cli + ["validate", str(root / step_dir_name(3)), "--digests"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "delta" in out.stdout
    dest = tmp_path / "hf"
    out = subprocess.run(
        cli + ["materialize", str(root), "--step", "3", "--out", str(dest)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert_same_files(dest, full_root / step_dir_name(3))
    again = subprocess.run(
        cli + ["materialize", str(root), "--step", "3", "--out", str(dest)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode != 0 and "exists" in again.stderr
    missing = subprocess.run(
        cli + ["materialize", str(root), "--step", "9", "--out", str(tmp_path / "n")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0 and "step-00000009" in missing.stderr


_APPLY_SCRIPT = r"""
import sys
from pathlib import Path
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.sidecar.staging import Stage
from rollout_service.untrusted_files import Deadline
root, stage_dir, step = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
stage = Stage(stage_dir)
print("ready", flush=True)
d = root / step_dir_name(step)
stage.build(root, d, Manifest.load(d), Deadline(600))
print("done", flush=True)
"""


def test_kills_at_random_moments_of_an_apply_never_leave_a_half_applied_copy(tmp_path: Path) -> None:
    shapes = {f"layer{i}.w": (1024, 1024) for i in range(24)}  # 48 MB in bf16: an apply takes a while
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-5, shapes=shapes)
    writer = DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3):
        publish_both(writer, root, full_root, step, model, max_shard_bytes=4 << 20)
        model.step()
    stage_dir = tmp_path / "stage"
    rng = random.Random(7)
    script = tmp_path / "apply.py"
    script.write_text(_APPLY_SCRIPT)
    timing = subprocess.Popen(
        [sys.executable, str(script), str(root), str(tmp_path / "timing"), "3"], stdout=subprocess.PIPE, text=True
    )
    assert timing.stdout is not None and timing.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    assert timing.stdout.readline().strip() == "done"
    whole = time.perf_counter() - t0  # the build alone, without the interpreter's start
    timing.wait(timeout=60)
    killed = 0
    for _ in range(20):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root), str(stage_dir), "3"], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, 0.9 * whole))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            # Mid-apply only when step 3's copy was not made yet (a kill after it counts for nothing).
            killed += not any(stage_dir.glob(f"{step_dir_name(3)}-*"))
        proc.wait(timeout=60)
        # Whatever is under a final name is complete and verified; the rest is hidden work.
        stage = Stage(stage_dir)  # removes .tmp-* leftovers
        try:
            for copy in stage.path.iterdir():
                if copy.name.startswith("step-"):
                    step = int(copy.name.split("-")[1])
                    assert_same_files(copy, full_root / step_dir_name(step))
            assert not [p for p in stage.path.iterdir() if p.name.startswith(".tmp-")]
            # Every copy goes: the next trial builds the whole chain again (a staged step 2 would
            # leave it one delta to apply, done before most kills land).
            for done in stage.path.glob("step-*"):
                shutil.rmtree(done)
        finally:
            stage.close()
    assert killed >= 10, f"only {killed} of 20 trials were killed mid-apply (apply took {whole:.2f} s)"
    stage = Stage(stage_dir)
    try:
        built = stage.build(root, root / step_dir_name(3), Manifest.load(root / step_dir_name(3)), Deadline(600))
        assert_same_files(built.path, full_root / step_dir_name(3))
    finally:
        stage.close()


def test_a_delta_that_brings_nan_is_refused_when_finiteness_is_checked(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = Model()
    writer = DeltaCheckpointWriter(check_finite=False)  # a writer that does not check: the reader must
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    with torch.no_grad():
        model.params["layer1.mlp"][3, 5] = float("nan")
    assert writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "delta"
    stage = Stage(tmp_path / "stage")
    try:
        two = root / step_dir_name(2)
        with pytest.raises(CheckpointError) as info:
            stage.build(root, two, Manifest.load(two), Deadline(60), check_finite=True)
        assert info.value.reason == "non_finite" and "layer1.mlp" in str(info.value)
        assert stage.build(root, two, Manifest.load(two), Deadline(60)).kind == "delta"  # unchecked: loads
    finally:
        stage.close()


def test_the_trainers_default_measures_and_true_forces_deltas() -> None:
    from types import SimpleNamespace

    from trainer_hooks.trainer import delta_writer_for

    def writer(delta: bool | None, dtype: str) -> DeltaCheckpointWriter | None:
        return delta_writer_for(SimpleNamespace(checkpoint_delta=delta, checkpoint_full_every=7), dtype)

    default = writer(None, "bfloat16")
    assert default is not None and default.costs is not None and default.costs.probe_every == 7
    forced = writer(True, "bfloat16")
    assert forced is not None and forced.costs is None and forced.full_every == 7
    assert writer(None, "float32") is None and writer(False, "bfloat16") is None
    assert writer(True, "float32") is not None


def test_a_relative_root_is_not_joined_to_itself(tmp_path: Path, monkeypatch) -> None:
    """`rollout-service validate ck/step-N`, `materialize ck` and a sidecar started on
    `--checkpoint-path ck` (as the README's demo does with a relative --output-dir) work from
    the root's parent: paths built from a relative root were joined to it a second time."""
    from rollout_service.checkpoint_reader import validate_checkpoint
    from rollout_service.delta_apply import materialize
    from rollout_service.sidecar.settings import SidecarSettings

    _chain(tmp_path, versions=3)  # root: tmp_path / "root", steps 1-3 (2 and 3 deltas)
    monkeypatch.chdir(tmp_path)
    assert validate_checkpoint("root/step-00000001").manifest.step == 1
    assert validate_checkpoint("root/step-00000001", root="root").manifest.step == 1
    assert materialize("root", 3, "out").step == 3
    settings = SidecarSettings(checkpoint_path=Path("root"), sglang_url="http://127.0.0.1:1", stage_dir=Path("st"))
    assert settings.checkpoint_path == tmp_path / "root" and settings.stage_dir == tmp_path / "st"
