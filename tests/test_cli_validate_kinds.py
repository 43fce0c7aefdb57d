"""`rollout-service validate` and `materialize` on every kind of step: an adapter step is
validated by the adapter rules (not reported as a full checkpoint without config.json), a delta
step with its chain (and the model it rebuilds, when its bytes are to be checked), a published
step given as --reference by its manifest, an
adapter step is not "materialized" into a broken chain, and materialize never writes a model
that validate rejects (a shard whose manifest vouches for bytes that are no safetensors file)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model
from rollout_service.adapter_reader import SELF_CHECKED
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import MANIFEST_NAME, CheckpointError, step_dir_name
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.cli import main
from rollout_service.delta_apply import materialize
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.digest import format_digest, new_hasher

CLI = [sys.executable, "-m", "rollout_service.cli"]
SHAPES = {"q_proj": (16, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 16)}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def base_tensors(scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    """A one-layer base model whose attention weights adapters change (``scale`` 2: another model)."""
    g = torch.Generator().manual_seed(0)
    return [
        (f"model.layers.0.self_attn.{m}.weight", torch.randn(rows * scale, cols * scale, generator=g))
        for m, (rows, cols) in SHAPES.items()
    ]


def lora_tensors(r: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for m in modules:
        rows, cols = SHAPES[m]
        prefix = f"base_model.model.model.layers.0.self_attn.{m}"
        out[f"{prefix}.lora_A.weight"] = torch.randn(r, cols, generator=g)
        out[f"{prefix}.lora_B.weight"] = torch.randn(rows, r, generator=g)
    return out


def lora_config(r: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> dict:
    return {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": sorted(modules), "bias": "none"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Step 1: the base model (full); step 2: a rank-4 adapter on its q_proj and v_proj."""
    root = tmp_path / "root"
    publish_checkpoint(root, 1, base_tensors(), config=CONFIG, run_id=RUN)
    publish_adapter(root, 2, lora_tensors(), lora_config(), run_id=RUN)
    return root


def vouch_for(step_dir: Path, fname: str, data: bytes) -> None:
    """Write ``data`` as ``fname`` and make the manifest vouch for it (size, digest, total; and a
    delta's target entry), as a writer that publishes garbage would."""
    (step_dir / fname).write_bytes(data)
    hasher = new_hasher()
    hasher.update(data)
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    entries = [manifest["files"][fname]]
    if manifest.get("delta") and fname in manifest["delta"]["target_files"]:
        entries.append(manifest["delta"]["target_files"][fname])
    for entry in entries:
        entry.update(size=len(data), digest=format_digest(hasher))
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"].values())
    (step_dir / MANIFEST_NAME).write_text(json.dumps(manifest))


def cli_reason(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run the CLI in this process: its exit code, and stderr (or the JSON it printed)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err if code else captured.out


# --- validate ---------------------------------------------------------------------------------
def test_the_cli_validates_an_adapter_step_by_the_adapter_rules(root: Path) -> None:
    adapter, base = root / step_dir_name(2), root / step_dir_name(1)
    plain = run_cli("validate", str(adapter))
    assert plain.returncode == 0, plain.stderr
    info = json.loads(plain.stdout)
    assert (info["kind"], info["step"], info["rank"], info["modules"]) == ("adapter", 2, 4, ["q_proj", "v_proj"])
    assert info["tensors"] == 4 and "config servable" in info["checks"] and SELF_CHECKED in info["checks"]
    full = run_cli("validate", str(adapter), "--reference", str(base), "--digests", "--check-finite")
    assert full.returncode == 0, full.stderr
    checks = json.loads(full.stdout)["checks"]
    assert {"tensors fit the served model", "digests match", "finite"} <= set(checks), checks
    again = run_cli("validate", str(base))  # a full step: still the full rules
    assert again.returncode == 0 and json.loads(again.stdout)["kind"] == "full", again.stderr


@pytest.mark.parametrize(
    "flags,reason,says",
    [
        (["--max-lora-rank", "2"], "adapter_unservable", "above the server's --max-lora-rank 2"),
        (["--lora-target-modules", "o_proj,gate_proj"], "adapter_unservable", "['q_proj', 'v_proj'] are not among"),
        (["--reference", "OTHER"], "adapter_mismatch", "at rank 4 it must be"),
    ],
)
def test_an_adapter_the_server_cannot_serve_is_invalid_with_the_adapter_reason(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], reason: str, says: str
) -> None:
    other = tmp_path / "other"
    publish_checkpoint(other, 1, base_tensors(scale=2), config=CONFIG, run_id=RUN)
    flags = [str(other / step_dir_name(1)) if f == "OTHER" else f for f in flags]
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(2)), *flags)
    assert code == 1 and err.startswith(f"INVALID ({reason}): step-00000002") and says in err, err


@pytest.mark.parametrize(
    "tensors,says",
    [
        (lambda: lora_tensors(r=3), "at rank 4 it must be"),  # the manifest says rank 4
        (
            lambda: {k: v for k, v in lora_tensors().items() if "v_proj.lora_B" not in k},
            "has no matching lora_A/lora_B",
        ),
    ],
)
def test_without_a_reference_an_adapter_is_checked_against_its_own_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tensors: Callable[[], dict[str, torch.Tensor]], says: str
) -> None:
    root = tmp_path / "root"
    publish_adapter(root, 1, tensors(), lora_config(r=4), run_id=RUN)
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(1)))
    assert code == 1 and err.startswith("INVALID (bad_adapter): ") and says in err, err


def test_an_adapter_step_that_is_not_readable_keeps_the_full_validators_reason(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / step_dir_name(2) / MANIFEST_NAME).write_text("{")
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(2)))
    assert code == 1 and err.startswith("INVALID (bad_manifest): "), err


def test_a_delta_step_is_validated_as_a_delta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    publish_delta_chain(root)
    code, out = cli_reason(capsys, "validate", str(root / step_dir_name(2)), "--digests")
    assert code == 0, out
    assert json.loads(out)["kind"] == "delta" and "delta files hold the blobs the manifest names" in out


# --- materialize ------------------------------------------------------------------------------
def test_materialize_refuses_an_adapter_step_saying_what_to_do_instead(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "made"
    made = run_cli("materialize", str(root), "--step", "2", "--out", str(out))
    assert made.returncode == 1, made.stderr
    assert "(adapter_step): step-00000002 is a LoRA adapter step" in made.stderr
    assert "PEFT adapter directory" in made.stderr and "rollout-service validate" in made.stderr
    assert "broken_chain" not in made.stderr
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_materialize_refuses_a_full_step_validate_rejects_with_validates_reason(root: Path, tmp_path: Path) -> None:
    step_dir = root / step_dir_name(1)
    vouch_for(step_dir, "model.safetensors", os.urandom(4096))  # digests match; no safetensors file
    checked = run_cli("validate", str(step_dir))
    assert checked.returncode == 1 and checked.stderr.startswith("INVALID (header_invalid): step-00000001/")
    out = tmp_path / "made"
    made = run_cli("materialize", str(root), "--step", "1", "--out", str(out))
    assert made.returncode == checked.returncode, made.stdout
    assert "(header_invalid): step-00000001/model.safetensors" in made.stderr, made.stderr
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def publish_delta_chain(root: Path) -> None:
    """Step 1 full, step 2 a delta on it (the delta test's model: ~4% of elements change)."""
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=10)
    for step in (1, 2):
        result = writer.publish(root, step, sorted(model.params.items()), config=CONFIG, dtype="bfloat16", run_id=RUN)
        assert result.kind == ("full" if step == 1 else "delta")
        model.step()


def test_materialize_validates_the_model_a_delta_rebuilds(tmp_path: Path) -> None:
    root = tmp_path / "root"
    publish_delta_chain(root)
    good = materialize(root, 2, tmp_path / "good")
    assert good.step == 2 and validate_checkpoint(tmp_path / "good").manifest.kind == "full"
    # A delta whose carried config.json is no JSON, every digest vouching for it.
    vouch_for(root / step_dir_name(2), "config.json", b"not json")
    with pytest.raises(CheckpointError) as checked:
        validate_checkpoint(root / step_dir_name(2))
    with pytest.raises(CheckpointError) as made:
        materialize(root, 2, tmp_path / "bad")
    assert made.value.reason == checked.value.reason == "bad_config", made.value
    assert "step-00000002/config.json" in str(made.value)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".tmp-*"))


# --- validate: what a replica needs of a delta step beyond its own files -------------------------
def publish_longer_chain(root: Path, nan_at: int | None = None) -> None:
    """Step 1 full, steps 2-3 deltas; with ``nan_at``, that step's weights hold a NaN (published
    by a writer told not to check, as a writer without the check would)."""
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=10, check_finite=False)
    for step in (1, 2, 3):
        params = dict(model.params)
        if step == nan_at:
            name = sorted(params)[0]
            params[name] = params[name].clone()
            params[name].view(-1)[3] = float("nan")
        result = writer.publish(root, step, sorted(params.items()), config=CONFIG, dtype="bfloat16", run_id=RUN)
        assert result.kind == ("full" if step == 1 else "delta")
        model.step()


def test_validate_refuses_a_delta_step_whose_chain_is_broken(tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    publish_longer_chain(root)
    code, out = cli_reason(capsys, "validate", str(root / step_dir_name(3)))
    assert code == 0 and "its delta chain back to full step 1 is published and consistent" in out, out
    os.rename(root / step_dir_name(2), tmp_path / "gone")
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(3)))
    assert code == 1 and err.startswith("INVALID (broken_chain): step-00000003 is a delta on step-00000002"), err


def test_validate_check_finite_rebuilds_a_delta_step_and_refuses_nan_in_it(tmp_path: Path, capsys, monkeypatch) -> None:
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    root = tmp_path / "root"
    publish_longer_chain(root, nan_at=3)
    code, out = cli_reason(capsys, "validate", str(root / step_dir_name(2)), "--check-finite", "--digests")
    assert code == 0, out
    checks = json.loads(out)["checks"]
    assert "the model it rebuilds matches the digests of a full publish, byte for byte" in checks
    assert "every floating weight of the rebuilt model is finite" in checks
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(3)), "--check-finite")
    assert code == 1 and err.startswith("INVALID (non_finite): "), err
    assert os.listdir(scratch) == [], "the rebuild was left behind"


def test_a_published_step_as_reference_is_read_by_its_manifest(tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    publish_longer_chain(root)
    step1 = str(root / step_dir_name(1))
    for ref in (step_dir_name(1), step_dir_name(3)):  # a full step, and the model a delta rebuilds
        code, out = cli_reason(capsys, "validate", step1, "--reference", str(root / ref))
        assert code == 0 and "tensor names, shapes and dtypes match the reference" in out, (ref, out)
    (root / step_dir_name(1) / "stray.safetensors").write_bytes(b"junk")  # not listed: not the reference
    code, out = cli_reason(capsys, "validate", str(root / step_dir_name(2)), "--reference", step1)
    assert code == 0, out


def test_validate_digests_refuses_a_delta_folder_not_named_as_its_step(tmp_path: Path, capsys) -> None:
    """The rebuild reads the step of that number from the root: a copy under another name would
    have the root's step checked in its place."""
    root = tmp_path / "root"
    publish_longer_chain(root)
    copy = root / "step-00000003.copy"
    shutil.copytree(root / step_dir_name(3), copy)
    code, err = cli_reason(capsys, "validate", str(copy), "--digests")
    assert code == 2 and "holds delta step 3 under another name" in err and step_dir_name(3) in err, err
    code, out = cli_reason(capsys, "validate", str(copy))  # its files and chain: checked as they are
    assert code == 0, out


def _deep_tree(top: Path, depth: int) -> None:
    """``top/d/d/.../d``, ``depth`` levels deep (made through descriptors: no path is that long)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)


def test_validate_digests_removes_the_rebuild_a_killed_validate_left(tmp_path: Path, capsys, monkeypatch) -> None:
    """A validate --digests killed outright (SIGKILL, OOM) leaves its rebuilt model, or the work
    folder of one, in $TMPDIR; the next run on this host removes those of dead processes only."""
    import tempfile

    from rollout_service.work_folders import owner_tag

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rebuilt = f"rollout-validate-{owner_tag(dead.pid)}-00000000aaaa"
    left = {
        "rebuilt": rebuilt,
        "working": f".tmp-materialize-{rebuilt}-{owner_tag(dead.pid)}-00000000bbbb",
        "live": f"rollout-validate-{owner_tag()}-00000000cccc",  # this process: still running
        "another tool's": f"other-{owner_tag(dead.pid)}-00000000dddd",
    }
    for name in left.values():
        (scratch / name).mkdir()
        (scratch / name / "model.safetensors").write_bytes(b"x" * 1000)
    _deep_tree(scratch / left["rebuilt"], 1500)  # too deep for shutil.rmtree: a RecursionError crashed validate
    root = tmp_path / "root"
    publish_longer_chain(root)
    code, out = cli_reason(capsys, "validate", str(root / step_dir_name(2)), "--digests")
    assert code == 0, out
    ours = sorted(n for n in os.listdir(scratch) if n.startswith(("rollout-validate-", ".tmp-", "other-")))
    assert ours == sorted([left["live"], left["another tool's"]])  # and nothing of this run either


def test_validate_names_the_reason_a_reference_is_refused(root: Path, capsys) -> None:
    """An adapter step given as --reference: exit 2 with the reason code the docs promise."""
    code, err = cli_reason(
        capsys, "validate", str(root / step_dir_name(1)), "--reference", str(root / step_dir_name(2))
    )
    assert code == 2 and err.startswith(f"error: cannot read --reference {root / step_dir_name(2)} (adapter_step): "), (
        err
    )
