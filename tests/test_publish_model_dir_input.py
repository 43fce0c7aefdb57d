"""`rollout-service publish --model-dir SRC`: the folder is input a user points at, and may be wrong.

Whatever is wrong with it (a delta or adapter step's folder, stray or missing shards, an index that
names files outside the folder, a config.json that is not a JSON object, more files than readers
accept, a corrupt, truncated or unloadable shard, a FIFO or a folder named like a shard) is one
`error: ...` line naming the file (and tensor) and what to do, exit 2, never a traceback nor a hang,
and nothing appears under the checkpoint root: no step, no `.tmp-*` work folder.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from delta_helpers import RUN, Model
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import INDEX_NAME, Manifest, step_dir_name
from rollout_service.checkpoint_reader import MAX_CHECKPOINT_ENTRIES, validate_checkpoint
from rollout_service.cli import main
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.untrusted_files import MAX_SMALL_FILE_BYTES

CONFIG = {"model_type": "qwen2", "hidden_size": 16}
CLI = [sys.executable, "-m", "rollout_service.cli"]


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(32, 16, generator=g),
    }


SHARDS = [["model.embed_tokens.weight", "model.norm.weight"], ["lm_head.weight"]]
SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def make_model_dir(path: Path, tensors: dict[str, torch.Tensor] | None = None, *, sharded: bool = False) -> Path:
    """An HF model folder: config.json and model.safetensors, or two shards and their index."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    tensors = weights() if tensors is None else tensors
    if not sharded:
        save_file(tensors, path / "model.safetensors")
        return path
    weight_map = {}
    for name, keys in zip(SHARD_NAMES, SHARDS):
        save_file({k: tensors[k] for k in keys}, path / name)
        weight_map.update({k: name for k in keys})
    write_index(path, weight_map)
    return path


def write_index(path: Path, weight_map: dict[str, str]) -> None:
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def publish(capsys: pytest.CaptureFixture[str], src: Path, root: Path, step: int, *extra: str) -> tuple[int, str]:
    argv = ["publish", "--model-dir", str(src), "--checkpoint-path", str(root), "--step", str(step), *extra]
    rc = main(argv)
    return rc, capsys.readouterr().err


def assert_refused(rc: int, err: str, root: Path, before: list[str], *words: str) -> None:
    """Exit 2 with one `error:` line holding ``words``, and the root as it was (no step, no .tmp-*)."""
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in line, (word, line)
    assert listing(root) == before


def assert_published(rc: int, err: str, root: Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    assert rc == 0, err
    report = validate_checkpoint(root / step_dir_name(step), check_digests=True)
    assert {k: v[0] for k, v in report.specs.items()} == {k: "F32" for k in tensors}
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_a_delta_step_folder_is_refused_pointing_at_materialize(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    writer = DeltaCheckpointWriter(full_every=100)
    model = Model()
    try:
        writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
        model.step()
        assert writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN).kind == "delta"
    finally:
        writer.close()
    before = listing(root)
    rc, err = publish(capsys, root / step_dir_name(2), root, 3)
    assert_refused(rc, err, root, before, "kind 'delta'", f"rollout-service materialize {root} --step 2 --out")
    # A full step's folder is a model folder: republishing it (a rollback) works.
    rc, err = publish(capsys, root / step_dir_name(1), root, 3)
    assert rc == 0, err
    assert Manifest.load(root / step_dir_name(3)).kind == "full"
    validate_checkpoint(root / step_dir_name(3), check_digests=True)


def test_an_adapter_step_folder_is_refused_as_not_a_full_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(0)
    lora = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4, generator=g),
    }
    lora_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    publish_adapter(root, 1, lora, lora_config, run_id=RUN)
    step = root / step_dir_name(1)
    (step / "config.json").write_text(json.dumps(CONFIG))  # the base model's config copied beside it
    before = listing(root)
    rc, err = publish(capsys, step, root, 2)
    assert_refused(rc, err, root, before, "kind 'adapter'", "publish_adapter", "not a full model")


def test_a_stray_safetensors_file_beside_indexed_shards_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_model_dir(tmp_path / "model", sharded=True)
    save_file({"ids": torch.arange(4, dtype=torch.int64)}, src / "consolidated.safetensors")
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], f"{INDEX_NAME} does not list: consolidated.safetensors")
    # A stale single-file copy beside the shards is as stray (not `tensor ... appears twice`).
    (src / "consolidated.safetensors").rename(src / "model.safetensors")
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], f"{INDEX_NAME} does not list: model.safetensors")
    # Exactly the shards the index lists are published.
    (src / "model.safetensors").unlink()
    rc, err = publish(capsys, src, root, 1, "--max-shard-mb", "0.002")
    assert_published(rc, err, root, 1, weights())


@pytest.mark.parametrize(
    "others",
    [["extra.safetensors"], ["model-00001-of-00002.safetensors"], ["weights.safetensors", "-model.safetensors"]],
    ids=["extra", "stale-shard", "no-model-safetensors"],
)
def test_without_an_index_only_a_lone_model_safetensors_is_published(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], others: list[str]
) -> None:
    src = make_model_dir(tmp_path / "model")
    for name in others:
        if name.startswith("-"):
            (src / name[1:]).unlink()
        else:
            save_file({"other.weight": torch.ones(2)}, src / name)
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], *[n for n in others if not n.startswith("-")])


@pytest.mark.parametrize(
    "entry", ["../outside.safetensors", "/abs/outside.safetensors", "sub/x.safetensors", "missing.safetensors"]
)
def test_the_index_names_shards_in_the_folder_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    src = make_model_dir(tmp_path / "model", sharded=True)
    save_file({"lm_head.weight": torch.ones(2)}, tmp_path / "outside.safetensors")
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = entry
    (src / INDEX_NAME).write_text(json.dumps(index))
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], INDEX_NAME, repr(entry))


def test_the_index_must_say_where_each_tensor_is_and_hf_cache_links_are_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_model_dir(tmp_path / "model", sharded=True)
    root = tmp_path / "root"
    # lm_head.weight in both shards: named with both files (not `appears twice in the published state`).
    tensors = weights()
    save_file({k: tensors[k] for k in [*SHARDS[0], "lm_head.weight"]}, src / SHARD_NAMES[0])
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], "'lm_head.weight'", SHARD_NAMES[0], SHARD_NAMES[1])
    # The index says a tensor is in a shard that lacks it.
    save_file({k: tensors[k] for k in SHARDS[0]}, src / SHARD_NAMES[0])
    write_index(src, {"model.embed_tokens.weight": SHARD_NAMES[0], "model.norm.weight": SHARD_NAMES[1]})
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], INDEX_NAME, "'model.norm.weight'", SHARD_NAMES[1])
    # The layout of a hub cache snapshot: every file a link into a blobs folder beside it.
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshot"
    make_model_dir(blobs, sharded=True)
    snapshot.mkdir()
    for name in [*SHARD_NAMES, INDEX_NAME, "config.json"]:
        (snapshot / name).symlink_to(Path("..") / "blobs" / name)
    rc, err = publish(capsys, snapshot, root, 1)
    assert_published(rc, err, root, 1, weights())


@pytest.mark.parametrize(
    "config, words",
    [
        (b"{not json", ["is not valid JSON"]),
        (b"[1, 2]", ["must hold a JSON object"]),
        (b"\xff\xfe{}", ["is not UTF-8"]),
        ("fifo", ["not a regular file (a FIFO)"]),
    ],
    ids=["not-json", "not-an-object", "not-utf8", "fifo"],
)
def test_a_bad_config_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: bytes | str, words: list[str]
) -> None:
    src = make_model_dir(tmp_path / "model")
    (src / "config.json").unlink()
    if config == "fifo":
        os.mkfifo(src / "config.json")
    else:
        assert isinstance(config, bytes)
        (src / "config.json").write_bytes(config)
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], "config.json", *words)


def test_more_files_than_readers_accept_is_refused_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One 1 KiB tensor per shard of at most 0.001 MiB: 10,001 shards + index + config: 10,003 files.
    count = MAX_CHECKPOINT_ENTRIES + 1
    src = make_model_dir(tmp_path / "model", {f"t{i:05d}": torch.ones(256) for i in range(count)})
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1, "--max-shard-mb", "0.001")
    assert_refused(rc, err, root, [], f"{count + 2} files", f"{MAX_CHECKPOINT_ENTRIES}", "--max-shard-mb")


def test_an_index_larger_than_readers_read_is_refused_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 90,000 tensors with 150-character names in two shards: a 17 MB index (readers read 16 MiB).
    count = 90_000
    src = make_model_dir(tmp_path / "model", {f"{i:06d}".ljust(150, "x"): torch.ones(1) for i in range(count)})
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1, "--max-shard-mb", "0.2")
    assert_refused(rc, err, root, [], INDEX_NAME, f"{MAX_SMALL_FILE_BYTES} readers read", "one shard")


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def _truncated() -> bytes:
    return _safetensors_bytes(weights())[:-100]


def _huge_header() -> bytes:
    return struct.pack("<Q", 200 << 20) + b"{" + b" " * 64


def _uint32() -> bytes:
    header = json.dumps({"w": {"dtype": "U32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(8)


@pytest.mark.parametrize(
    "content, words",
    [
        (b"this is not a safetensors file at all", ["model.safetensors", "safetensors"]),
        (b"", ["model.safetensors", "safetensors"]),
        (_truncated(), ["model.safetensors", "safetensors"]),
        (_huge_header(), ["model.safetensors", "safetensors"]),
        (_uint32(), ["model.safetensors", "tensor 'w'", "U32"]),
    ],
    ids=["garbage", "empty", "truncated", "oversized-header", "uint32"],
)
def test_an_unreadable_shard_is_named_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, words: list[str]
) -> None:
    src = make_model_dir(tmp_path / "model")
    (src / "model.safetensors").write_bytes(content)
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], *words, "Nothing was published")


def test_a_folder_named_like_a_shard_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_model_dir(tmp_path / "model")
    (src / "sub.safetensors").mkdir()
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], "sub.safetensors (a directory)")
    shutil.rmtree(src / "sub.safetensors")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").mkdir()
    rc, err = publish(capsys, src, root, 1)
    assert_refused(rc, err, root, [], "model.safetensors", "not a regular file (a directory)")


@pytest.mark.parametrize("how", ["stray", "link"])
def test_a_fifo_named_like_a_shard_is_refused_without_hanging(tmp_path: Path, how: str) -> None:
    src = make_model_dir(tmp_path / "model")
    if how == "stray":
        os.mkfifo(src / "a.safetensors")
        words = ["a.safetensors (a FIFO)"]
    else:
        os.mkfifo(tmp_path / "fifo")
        (src / "model.safetensors").unlink()
        (src / "model.safetensors").symlink_to(tmp_path / "fifo")
        words = ["model.safetensors", "not a regular file (a FIFO)"]
    root = tmp_path / "root"
    root.mkdir()
    out = subprocess.run(
        [*CLI, "publish", "--model-dir", str(src), "--checkpoint-path", str(root), "--step", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_refused(out.returncode, out.stderr, root, [], *words)


def test_a_header_safetensors_reads_with_a_key_given_twice_is_published_as_it_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """safetensors (and so SGLang) reads a header whose key is given twice, the last one counting;
    the publisher's second look at the header reads it the same way (before: "changed while it
    was read", with nothing changing it)."""
    src = make_model_dir(tmp_path / "model")
    w = weights()
    norm = w["model.norm.weight"].numpy().tobytes()
    head = '{"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
    head += f'"model.norm.weight": {{"dtype": "F32", "shape": [16], "data_offsets": [0, {len(norm)}]}}}}'
    raw = head.encode() + b" " * (-len(head) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + norm)
    root = tmp_path / "root"
    rc, err = publish(capsys, src, root, 1)
    assert rc == 0, err
    from safetensors.torch import load_file

    assert torch.equal(
        load_file(str(root / "step-00000001" / "model.safetensors"))["model.norm.weight"], w["model.norm.weight"]
    )
