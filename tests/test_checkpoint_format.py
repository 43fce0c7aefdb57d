"""The checkpoint format: atomic publication, listing, and validation with precise errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import (
    latest_checkpoint,
    list_checkpoints,
    read_model_specs,
    validate_checkpoint,
)
from rollout_service.checkpoint_writer import (
    cleanup_stale_temp_dirs,
    iter_unique_tensors,
    publish_checkpoint,
)

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}


def make_state(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(dtype),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(dtype),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g).to(dtype),
        "model.norm.weight": torch.ones(16, dtype=dtype),
        "lm_head.weight": torch.randn(64, 16, generator=g).to(dtype),
    }


def publish(root: Path, step: int, state=None, **kw):
    state = make_state(step) if state is None else state
    return publish_checkpoint(root, step, state.items(), config=CONFIG, **kw)


def expect_error(reason: str, match: str, path: Path, **kw) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as info:
        validate_checkpoint(path, **kw)
    assert info.value.reason == reason, str(info.value)
    return info.value


def test_publish_round_trips_tensors_and_manifest(tmp_path):
    state = make_state(3)
    result = publish(tmp_path, 3, state)
    assert result.path == tmp_path / "step-00000003"
    loaded = load_file(str(result.path / "model.safetensors"))
    assert loaded.keys() == state.keys()
    for k in state:
        assert torch.equal(loaded[k], state[k])
    manifest = Manifest.load(result.path)
    assert manifest.step == 3 and manifest.weight_version == "3"
    assert manifest.tensor_count == len(state) and manifest.dtype == "F32"
    assert manifest.total_bytes == sum(p.stat().st_size for p in result.path.iterdir() if p.name != "manifest.json")
    assert set(manifest.files) == {"model.safetensors", "config.json"}
    assert manifest.files["model.safetensors"].digest.startswith("xxh3_128:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]  # the rename is the only signal
    report = validate_checkpoint(result.path, check_digests=True)
    assert report.specs["model.norm.weight"] == ("F32", (16,))


def test_sharded_publish_writes_index_and_converts_dtype(tmp_path):
    state = make_state(1)
    result = publish(tmp_path, 1, state, dtype="bfloat16", max_shard_bytes=3000)
    shards = sorted(p.name for p in result.path.glob("*.safetensors"))
    assert len(shards) >= 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((result.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    merged = {}
    for s in shards:
        merged.update(load_file(str(result.path / s)))
    for k, v in state.items():
        assert merged[k].dtype == torch.bfloat16
        assert torch.equal(merged[k], v.to(torch.bfloat16))
    assert Manifest.load(result.path).dtype == "BF16"
    validate_checkpoint(result.path, check_digests=True)


def test_listing_is_in_step_order_and_ignores_temp_and_other_entries(tmp_path):
    for step in (10, 2, 7):
        publish(tmp_path, step)
    (tmp_path / ".tmp-step-00000099-abc").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-12").mkdir()
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 7, 10]
    assert latest_checkpoint(tmp_path).step == 10


def test_publishing_an_existing_step_is_refused(tmp_path):
    publish(tmp_path, 1)
    with pytest.raises(FileExistsError, match="already published"):
        publish(tmp_path, 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_tied_duplicates_are_dropped():
    emb = torch.randn(8, 4)
    state = [("embed.weight", emb), ("lm_head.weight", emb), ("other", torch.randn(3))]
    assert [n for n, _ in iter_unique_tensors(state)] == ["embed.weight", "other"]


def test_cleanup_removes_only_stale_temp_dirs(tmp_path):
    publish(tmp_path, 1)
    old = tmp_path / ".tmp-step-00000002-dead"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / ".tmp-step-00000003-live"
    fresh.mkdir()
    assert cleanup_stale_temp_dirs(tmp_path, older_than_s=3600) == [old]
    assert fresh.exists() and (tmp_path / "step-00000001").exists()


def test_a_sweep_of_a_root_flooded_with_temporary_entries_is_bounded(tmp_path, monkeypatch, caplog):
    """Each sweep collects and removes a bounded number of stale entries and lists no further
    than every reader of the root (a review, session 31: the sweep kept and removed every one of
    300,000 stray ``.tmp-*`` files at once, listed without end)."""
    from rollout_service import checkpoint_reader, checkpoint_writer

    for i in range(10):
        (tmp_path / f".tmp-x{i}").write_bytes(b"")
    monkeypatch.setattr(checkpoint_writer, "MAX_STALE_PER_SWEEP", 3)
    with caplog.at_level("WARNING", logger="rollout_service.checkpoint_writer"):
        removed = [len(cleanup_stale_temp_dirs(tmp_path, older_than_s=0)) for _ in range(4)]
    assert removed == [3, 3, 3, 1]
    assert "the rest wait for the next sweep" in caplog.text
    monkeypatch.setattr(checkpoint_writer, "MAX_STALE_PER_SWEEP", 1000)
    for i in range(10):
        (tmp_path / f".tmp-y{i}").write_bytes(b"")
    monkeypatch.setattr(checkpoint_reader, "MAX_ROOT_ENTRIES", 4)  # every reader of the root stops there
    assert len(checkpoint_writer.stale_temp_entries(tmp_path, older_than_s=0)) <= 4


# --- validation failures, each with its own reason and message -------------------------------


def test_truncated_shard_is_rejected(tmp_path):
    path = publish(tmp_path, 1).path
    shard = path / "model.safetensors"
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    expect_error("truncated", rf"model.safetensors is truncated: {size - 100} bytes on disk", path)


def test_flipped_bytes_are_caught_by_digests(tmp_path):
    path = publish(tmp_path, 1).path
    shard = path / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    validate_checkpoint(path)  # sizes and headers still agree: only digests can see it
    expect_error("digest_mismatch", r"model.safetensors has digest .* bytes changed", path, check_digests=True)


def test_missing_file_is_rejected(tmp_path):
    path = publish(tmp_path, 1).path
    (path / "config.json").unlink()
    expect_error("missing_file", r"config.json is listed in the manifest but does not exist", path)


def test_missing_and_extra_tensors_are_rejected(tmp_path):
    reference_state = make_state(0)
    ref = publish(tmp_path, 1, reference_state).path
    reference = read_model_specs(ref)
    fewer = dict(reference_state)
    del fewer["model.norm.weight"]
    path = publish(tmp_path, 2, fewer).path
    expect_error("missing_tensor", r"lacks 1 tensor\(s\) .*model.norm.weight", path, reference=reference)
    more = dict(reference_state, **{"model.extra.bias": torch.zeros(4)})
    path = publish(tmp_path, 3, more).path
    expect_error("extra_tensor", r"has 1 tensor\(s\) the reference lacks.*model.extra.bias", path, reference=reference)


def test_wrong_shape_and_dtype_are_rejected(tmp_path):
    reference = read_model_specs(publish(tmp_path, 1).path)
    state = make_state(2)
    state["model.norm.weight"] = torch.ones(17)
    path = publish(tmp_path, 2, state).path
    expect_error(
        "shape_mismatch", r"'model.norm.weight' has shape \[17\], the reference has \[16\]", path, reference=reference
    )
    path = publish(tmp_path, 3, make_state(3, torch.bfloat16)).path
    expect_error("dtype_mismatch", r"has dtype BF16, the reference has F32", path, reference=reference)
    validate_checkpoint(path, reference=reference, allow_float_cast=True)
    mixed = make_state(4)
    mixed["model.norm.weight"] = torch.ones(16, dtype=torch.float16)
    path = publish(tmp_path, 4, mixed, dtype=None).path
    # A checkpoint whose floating tensors disagree has no single dtype in its manifest ...
    assert Manifest.load(path).dtype is None
    # ... and a reference catches the odd one.
    expect_error("dtype_mismatch", r"'model.norm.weight' has dtype F16", path, reference=reference)


def test_manifest_size_mismatch_is_rejected(tmp_path):
    path = publish(tmp_path, 1).path
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["config.json"]["size"] -= 1
    manifest["total_bytes"] -= 1  # a consistent manifest: its sizes add up, the disk's do not
    (path / "manifest.json").write_text(json.dumps(manifest))
    expect_error("size_mismatch", r"config.json has \d+ bytes on disk, the manifest says", path)
    manifest["total_bytes"] += 1  # total_bytes is checked against the listed sizes first
    (path / "manifest.json").write_text(json.dumps(manifest))
    expect_error("bad_manifest", r"total_bytes is \d+, the files it lists add up to", path)


def test_symlink_escaping_the_root_is_rejected(tmp_path):
    root = tmp_path / "root"
    path = publish(root, 1).path
    outside = tmp_path / "outside.json"
    outside.write_text((path / "config.json").read_text())
    (path / "config.json").unlink()
    (path / "config.json").symlink_to(outside)
    expect_error("path_escape", r"outside the checkpoint root", path, root=root)
    # A whole checkpoint directory linked in from outside is refused too: under another name
    # for leaving the root, under a step's name for being a link at all.
    other = publish(tmp_path / "elsewhere", 5).path
    (root / "latest").symlink_to(other)
    expect_error("path_escape", r"outside the checkpoint root", root / "latest", root=root)
    (root / "step-00000005").symlink_to(other)
    expect_error("not_a_checkpoint", r"is a symbolic link", root / "step-00000005", root=root)


def test_missing_manifest_is_rejected(tmp_path):
    path = publish(tmp_path, 1).path
    (path / "manifest.json").unlink()
    expect_error("missing_manifest", r"manifest.json does not exist", path)


def test_corrupt_header_and_unlisted_shard_are_rejected(tmp_path):
    path = publish(tmp_path, 1).path
    shard = path / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[0:8] = (10**6).to_bytes(8, "little")  # header length beyond the file
    shard.write_bytes(bytes(data))
    expect_error("header_invalid", r"safetensors header does not describe the file", path)
    path = publish(tmp_path, 2).path
    (path / "extra.safetensors").write_bytes(b"")
    expect_error("unlisted_file", r"extra.safetensors is not in the manifest", path)


def test_an_unlisted_index_is_refused_because_it_picks_what_sglang_loads(tmp_path):
    """An index the manifest does not list decides which shards SGLang's loader reads: one naming
    no listed shard makes it load nothing ("Cannot find any model weights")."""
    from sglang.srt.model_loader.weight_utils import filter_duplicate_safetensors_files

    path = publish(tmp_path, 1).path
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "config.json"}}))
    shards = [str(path / "model.safetensors")]
    assert filter_duplicate_safetensors_files(shards, str(path), "model.safetensors.index.json") == []
    expect_error("unlisted_file", r"model.safetensors.index.json is not in the manifest", path)


def test_bad_step_numbers_are_refused(tmp_path):
    for bad in (-1, 10**8, "3", 1.0):
        with pytest.raises(ValueError, match="step must be an integer"):
            step_dir_name(bad)


# --- crash safety ---------------------------------------------------------------------------

_KILL_WRITER = r"""
import sys, torch
from rollout_service.checkpoint_writer import publish_checkpoint
root = sys.argv[1]
g = torch.Generator().manual_seed(0)
state = [(f"layer.{i}.weight", torch.randn(256, 256, generator=g)) for i in range(24)]
print("ready", flush=True)
for step in range(1, 1000):
    publish_checkpoint(root, step, state, config={"model_type": "qwen2"}, max_shard_bytes=1 << 20)
"""


@pytest.mark.slow  # subprocesses with torch start-ups: several seconds
def test_sigkill_during_publish_never_leaves_a_visible_partial_checkpoint(tmp_path):
    import random

    rng = random.Random(1234)
    script = tmp_path / "writer.py"
    script.write_text(_KILL_WRITER)
    trials = 12
    killed_mid_write = 0
    for trial in range(trials):
        root = tmp_path / f"root{trial}"
        root.mkdir()
        proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.6))
        proc.kill()
        proc.wait()
        temp = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
        killed_mid_write += bool(temp)
        for ckpt in list_checkpoints(root):
            validate_checkpoint(ckpt.path, check_digests=True)
        # The next writer's clean-up removes what the dead one left.
        cleanup_stale_temp_dirs(root, older_than_s=0)
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert killed_mid_write >= trials // 3, "the kills should land mid-write most of the time"
