"""Crafted entries under a checkpoint root: every one is rejected with a reason, quickly,
without blocking or unbounded reads, and `rollout-service validate` never shows a traceback.

No SGLang here; the sidecar-level behaviour is in test_sidecar_untrusted.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout_service.checkpoint_format import CheckpointError, parse_step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints, validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.protocol import ReplicaReport
from rollout_service.sidecar.acks import AckWriter, read_acks

PUBLISH_CONFIG = {"model_type": "qwen2"}


def make_state(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g).to(dtype),
        "model.norm.weight": torch.randn(16, generator=g).to(dtype),
    }


def publish(root: Path, step: int, state=None, **kw):
    return publish_checkpoint(root, step, (state or make_state(step)).items(), config=PUBLISH_CONFIG, **kw).path


def validate_in_thread(path: Path, limit_s: float = 10.0, **kw) -> CheckpointError:
    """Validate in a thread and require an answer within ``limit_s`` (a hang fails the test)."""
    out: dict = {}

    def work():
        try:
            out["report"] = validate_checkpoint(path, **kw)
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            out["error"] = exc

    t = threading.Thread(target=work, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"validation of {path.name} blocked for more than {limit_s} s"
    assert "error" in out, f"{path.name} was accepted: {out.get('report')}"
    err = out["error"]
    assert isinstance(err, CheckpointError), f"{type(err).__name__} escaped: {err}"
    assert time.monotonic() - t0 < limit_s
    return err


def cli_validate(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_service.cli", "validate", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_cli_invalid(path: Path, reason: str, *extra: str) -> None:
    proc = cli_validate(path, *extra)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.startswith(f"INVALID ({reason}): "), proc.stderr
    assert "Traceback" not in proc.stderr


def rewrite_manifest(path: Path, text: str | bytes) -> None:
    target = path / "manifest.json"
    target.unlink()
    if isinstance(text, str):
        target.write_text(text)
    else:
        target.write_bytes(text)


# --- class 2: every entry is untrusted -------------------------------------------------------


@pytest.mark.parametrize("victim", ["manifest.json", "config.json", "model.safetensors"])
def test_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path, victim):
    path = publish(tmp_path, 1)
    (path / victim).unlink()
    os.mkfifo(path / victim)
    err = validate_in_thread(path)
    assert err.reason == "not_a_regular_file" and "FIFO" in str(err), err
    assert_cli_invalid(path, "not_a_regular_file")


def test_device_file_inside_the_root_is_refused(tmp_path):
    path = publish(tmp_path, 1)
    (path / "manifest.json").unlink()
    os.mknod(path / "manifest.json", stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero
    err = validate_in_thread(path)
    assert err.reason == "not_a_regular_file" and "character device" in str(err)


@pytest.mark.parametrize("victim", ["manifest.json", "model.safetensors"])
def test_a_socket_in_place_of_a_file_is_named_as_such(tmp_path, victim):
    import socket

    path = publish(tmp_path, 1)
    (path / victim).unlink()
    with socket.socket(socket.AF_UNIX) as listener:  # a stray process's socket (open() gives ENXIO)
        listener.bind(str(path / victim))
        err = validate_in_thread(path)
    assert err.reason == "not_a_regular_file" and "a socket" in str(err), err


def test_a_folder_swapped_for_a_link_out_of_the_root_after_the_check_is_refused(tmp_path, monkeypatch):
    # The race O_NOFOLLOW cannot close: the path was checked inside the root, then a folder on it
    # became a link to elsewhere before the open. Simulated by skipping the check before the
    # open: what is opened is checked again, on its descriptor.
    from rollout_service import untrusted_files

    root = tmp_path / "root"
    path = publish(root, 1)
    outside = tmp_path / "elsewhere"
    os.rename(path, outside)
    path.symlink_to(outside)
    monkeypatch.setattr(untrusted_files, "resolve_inside", lambda root, candidate: Path(candidate))
    with pytest.raises(CheckpointError) as err:
        untrusted_files.read_small(root, path / "manifest.json", where="step-00000001/manifest.json")
    assert err.value.reason == "path_escape" and "elsewhere" not in str(err.value)
    os.unlink(path)
    os.rename(outside, path)  # the same file, inside the root: read
    assert json.loads(untrusted_files.read_small(root, path / "manifest.json", where="m"))["step"] == 1


def test_a_folder_swapped_for_a_link_right_after_the_check_is_refused_without_opening_anything_there(
    tmp_path, monkeypatch
):
    """The swap lands between the check and the open: nothing where the link points is opened (on
    a hung mount there, an open would block the reader in the kernel for good)."""
    from rollout_service import untrusted_files

    root = tmp_path / "root"
    path = publish(root, 1)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")
    check = untrusted_files.resolve_inside

    def check_then_swap(root_, candidate):
        resolved = check(root_, candidate)  # a real folder inside the root when checked
        os.rename(path, tmp_path / "moved")
        path.symlink_to(outside)
        return resolved

    opened = []
    real_open = os.open

    def tracing_open(target, flags, *args, **kwargs):
        fd = real_open(target, flags, *args, **kwargs)
        opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fd

    monkeypatch.setattr(untrusted_files, "resolve_inside", check_then_swap)
    monkeypatch.setattr(os, "open", tracing_open)
    with pytest.raises(CheckpointError) as err:
        untrusted_files.read_small(root, path / "manifest.json", where="step-00000001/manifest.json")
    monkeypatch.undo()
    assert err.value.reason == "path_escape" and "elsewhere" not in str(err.value)
    assert not [p for p in opened if "elsewhere" in p], opened


def test_manifest_symlinked_out_of_the_root_is_refused_and_not_disclosed(tmp_path):
    root = tmp_path / "root"
    path = publish(root, 1)
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to("/dev/zero")
    err = validate_in_thread(path, root=root)
    assert err.reason == "path_escape"
    assert "/dev/zero" not in str(err), "the error must not disclose where outside the root it points"
    secret = tmp_path / "secret-location" / "m.json"
    secret.parent.mkdir()
    secret.write_text("{}")
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to(secret)
    err = validate_in_thread(path, root=root)
    assert err.reason == "path_escape" and "secret-location" not in str(err)


def test_oversized_manifest_is_refused_without_reading_it(tmp_path):
    path = publish(tmp_path, 1)
    with open(path / "manifest.json", "r+b") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of zeros
    err = validate_in_thread(path)
    assert err.reason == "too_large" and str(64 << 20) in str(err)


def test_validation_has_a_deadline(tmp_path):
    state = {f"layer.{i}": torch.randn(512, 512) for i in range(32)}  # 32 MiB
    path = publish(tmp_path, 1, state)
    err = validate_in_thread(path, check_digests=True, check_finite=True, timeout_s=1e-6)
    assert err.reason == "validation_timeout" and "--validate-timeout" in str(err)
    validate_checkpoint(path, check_digests=True, check_finite=True, timeout_s=60)


# --- class 3: any failure is a rejection with a reason ----------------------------------------


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


BAD_MANIFESTS = {
    "deep_nesting": lambda m: "[" * 100_000 + "]" * 100_000,
    "infinity_size": lambda m: json.dumps(m).replace(f'"total_bytes": {m["total_bytes"]}', '"total_bytes": Infinity'),
    "nan_created_at": lambda m: json.dumps(m).replace(f'"created_at": {m["created_at"]}', '"created_at": NaN'),
    "huge_int_created_at": lambda m: json.dumps({**m, "created_at": 10**400}),
    "non_utf8": lambda m: b"\xff\xfe" + json.dumps(m).encode(),
    "files_is_a_list": lambda m: json.dumps({**m, "files": [1, 2]}),
    "size_is_a_string": lambda m: json.dumps(
        {**m, "files": {k: {**v, "size": str(v["size"])} for k, v in m["files"].items()}}
    ),
    "size_is_a_float": lambda m: json.dumps(
        {**m, "files": {k: {**v, "size": v["size"] + 0.5} for k, v in m["files"].items()}}
    ),
    "size_is_negative": lambda m: json.dumps({**m, "total_bytes": -1}),
    "size_is_huge": lambda m: json.dumps({**m, "total_bytes": 10**40}),
    "step_is_bool": lambda m: json.dumps({**m, "step": True}),
    "entry_is_a_number": lambda m: json.dumps({**m, "files": {"model.safetensors": 3}}),
    "digest_is_an_object": lambda m: json.dumps(
        {**m, "files": {k: {**v, "digest": {"x": 1}} for k, v in m["files"].items()}}
    ),
    "top_level_array": lambda m: json.dumps([m]),
    "bad_run_id": lambda m: json.dumps({**m, "run_id": "../../etc"}),
    "empty": lambda m: "",
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_malformed_manifests_are_rejections_with_a_reason(tmp_path, case):
    path = publish(tmp_path, 1)
    rewrite_manifest(path, BAD_MANIFESTS[case](_manifest(path)))
    err = validate_in_thread(path)
    assert err.reason == "bad_manifest", (case, err.reason, str(err))
    assert_cli_invalid(path, "bad_manifest")


def test_symlink_loop_is_a_rejection(tmp_path):
    path = publish(tmp_path, 1)
    (path / "manifest.json").unlink()
    (path / "a").symlink_to(path / "manifest.json")
    (path / "manifest.json").symlink_to(path / "a")
    err = validate_in_thread(path)
    assert err.reason in ("not_a_regular_file", "path_escape"), err
    assert_cli_invalid(path, err.reason)


@pytest.mark.parametrize("weight_map", [[1, 2], {"a": [1]}, {"model.norm.weight": 5}, "x", None])
def test_wrong_json_types_in_the_index_are_rejections(tmp_path, weight_map):
    state = {f"layer.{i}": torch.randn(64, 64) for i in range(4)}
    path = publish(tmp_path, 1, state, max_shard_bytes=20_000)
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = weight_map
    text = json.dumps(data)
    manifest = _manifest(path)
    from rollout_service.digest import file_digest

    index.write_text(text)
    manifest["files"]["model.safetensors.index.json"].update(size=index.stat().st_size, digest=file_digest(index))
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"].values())
    rewrite_manifest(path, json.dumps(manifest))
    err = validate_in_thread(path)
    assert err.reason == "index_mismatch", err


def test_config_that_is_not_json_is_a_rejection(tmp_path):
    path = publish(tmp_path, 1)
    config = path / "config.json"
    size = config.stat().st_size
    config.write_bytes(b"\xff" * size)  # same size: only parsing it can tell
    err = validate_in_thread(path)
    assert err.reason == "bad_config"


def test_integer_tensors_cannot_stand_in_for_weights(tmp_path):
    state = make_state(1)
    state["model.norm.weight"] = torch.arange(16, dtype=torch.int32)
    path = publish(tmp_path, 1, state)
    err = validate_in_thread(path)  # no reference: only loadable floating dtypes pass
    assert err.reason == "dtype_unloadable" and "I32" in str(err)
    reference = {k: ("F32", tuple(v.shape)) for k, v in make_state(0).items()}
    err = validate_in_thread(path, reference=reference, allow_float_cast=True)
    assert err.reason == "dtype_mismatch"  # and whatever the reference allows for floats


# --- class 5: step names are ASCII digits only ------------------------------------------------


def test_only_ascii_digit_step_names_are_steps(tmp_path):
    publish(tmp_path, 3)
    for name in (
        "step-\uff10\uff10\uff10\uff10\uff10\uff10\uff19\uff19",  # fullwidth digits
        "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0669\u0669",  # Arabic-Indic digits
        "step-00000099\n",
        "step-000000099",
        "step-0000009",
    ):
        assert parse_step_dir_name(name) is None, name
        (tmp_path / name).mkdir()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]


# --- class 6: weights that are not finite -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_rejected_when_bytes_are_read(tmp_path, dtype, bad):
    state = make_state(1, dtype)
    state["model.norm.weight"][5] = bad
    path = publish(tmp_path, 1, state, check_finite=False)  # a writer that does not check: the reader must
    validate_checkpoint(path)  # headers alone cannot see it
    err = validate_in_thread(path, check_finite=True)
    assert err.reason == "non_finite" and "model.norm.weight holds 1 NaN/Inf" in str(err)
    assert_cli_invalid(path, "non_finite", "--check-finite")
    fine = publish(tmp_path, 2, make_state(2, dtype))
    validate_checkpoint(fine, check_finite=True, check_digests=True)


# --- class 7: acks stay inside the root -------------------------------------------------------


def test_symlinked_acks_dir_is_not_followed(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "acks").symlink_to(outside)
    with pytest.raises(OSError, match="not a plain directory"):
        AckWriter(root, "r0").write(ReplicaReport("r0", loaded_step=1))
    assert list(outside.iterdir()) == []
    assert read_acks(root) == {}


def test_killed_writers_temp_ack_files_are_cleaned_up(tmp_path):
    writer = AckWriter(tmp_path, "r0")
    writer.write(ReplicaReport("r0", loaded_step=1))
    acks = tmp_path / "acks"
    (acks / ".tmp-r0-deadbeef").write_text("half")
    (acks / ".tmp-r1-cafecafe").write_text("another replica, maybe in flight")
    old = acks / ".tmp-r2-00000000"
    old.write_text("ancient")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert writer.clean_up_leftovers() == 2
    assert sorted(p.name for p in acks.iterdir()) == [".tmp-r1-cafecafe", "r0.json"]
    assert read_acks(tmp_path)["r0"]["loaded_step"] == 1


def test_unreadable_ack_files_are_skipped(tmp_path):
    AckWriter(tmp_path, "good").write(ReplicaReport("good", loaded_step=2))
    os.mkfifo(tmp_path / "acks" / "fifo.json")
    (tmp_path / "acks" / "list.json").write_text("[1]")
    (tmp_path / "acks" / "big.json").write_bytes(b" " * (1 << 20))
    assert list(read_acks(tmp_path)) == ["good"]


def test_a_stage_directory_serves_one_sidecar_only(tmp_path):
    from rollout_service.sidecar.staging import Stage, StageError

    first = Stage(tmp_path / "stage")
    (tmp_path / "stage" / ".tmp-step-00000001-x-1234").mkdir()  # a copy a killed sidecar left
    with pytest.raises(StageError, match="another sidecar uses the stage directory"):
        Stage(tmp_path / "stage")
    first.close()
    Stage(tmp_path / "stage").close()  # free again once the first one is gone ...
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "stage").iterdir())  # ... and cleaned


def test_removing_a_stage_deletes_its_copies_and_frees_the_directory(tmp_path, tiny_model_dir):
    from rollout_service.checkpoint_format import Manifest
    from rollout_service.model_dir_source import iter_model_dir_tensors
    from rollout_service.sidecar.staging import Stage, StageError
    from rollout_service.untrusted_files import Deadline

    root = tmp_path / "root"
    result = publish_checkpoint(root, 1, iter_model_dir_tensors(tiny_model_dir), config=tiny_model_dir / "config.json")
    stage = Stage(tmp_path / "stage")
    built = stage.build(root, result.path, Manifest.load(result.path), Deadline(None))
    assert built.path.is_dir() and stage.usage_bytes() >= result.total_bytes
    assert stage.remove() >= result.total_bytes
    assert not (tmp_path / "stage").exists()
    Stage(tmp_path / "stage").close()  # the lock went with it: a new sidecar may use the path
    # Removing after close (serve: the sidecar closed its stage, then SGLang stopped) while another
    # sidecar took the directory in between leaves that sidecar's stage alone.
    mine = Stage(tmp_path / "stage")
    mine.build(root, result.path, Manifest.load(result.path), Deadline(None))
    mine.close()
    theirs = Stage(tmp_path / "stage")
    with pytest.raises(StageError, match="another sidecar uses the stage directory"):
        mine.remove()
    assert (tmp_path / "stage" / ".lock").exists() and any(p.name.startswith("step-") for p in theirs.path.iterdir())
    theirs.close()
    assert mine.remove() > 0 and not (tmp_path / "stage").exists()  # free again: removed
