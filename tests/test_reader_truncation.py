"""A shard truncated (or grown) while ``--digests``/``--check-finite`` reads it is rejected, not fatal.

Validation reads untrusted root files whole for digests and the NaN/Inf check. A mapped file that
someone truncates mid-scan kills the process with SIGBUS (no rejection, no log line), so each
scenario runs in a child process: a crash there shows up as this test's failure. The truncation
is real (``os.truncate`` on the real shard); only its trigger is hooked, at a deterministic
point: the second deadline check made while the shard is read whole, i.e. after the first chunk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import rollout_service.checkpoint_reader as cr
from rollout_service.checkpoint_format import CheckpointError
from rollout_service.checkpoint_reader import read_every_byte, validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.digest import file_digest
from rollout_service.untrusted_files import NO_DEADLINE

BIG_ELEMENTS = 25 << 20  # one F32 tensor of 100 MiB (sparse: no disk, no memory): more than one chunk

# Child: hook the trigger, validate, print what came out. argv: checkpoint dir, mode, action.
CHILD = r"""
import json, os, sys
from pathlib import Path
from typing import Any
import rollout_service.checkpoint_reader as cr
from rollout_service.checkpoint_format import CheckpointError

ckpt, mode, action = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
shard = ckpt / "model.safetensors"
scanning = []  # True while the shard is being read whole
fired = []
real_read_every_byte = cr.read_every_byte


def read_every_byte(root, path, *args, **kw):
    scanning.append(Path(path).name == shard.name)
    try:
        return real_read_every_byte(root, path, *args, **kw)
    finally:
        scanning.pop()


class HookedDeadline(cr.Deadline):
    calls = 0

    def check(self, where=""):
        if scanning and scanning[-1] and not fired:
            HookedDeadline.calls += 1
            if HookedDeadline.calls == 2 and action != "none":  # past the first chunk: the "writer" strikes
                fired.append(os.path.getsize(shard))
                if action == "truncate":
                    os.truncate(shard, 4096)
                else:
                    with open(shard, "ab") as f:
                        f.write(b"\0" * 4096)
        super().check(where)


cr.read_every_byte = read_every_byte
cr.Deadline = HookedDeadline
if mode == "cli":
    from rollout_service.cli import main

    rc = main(["validate", str(ckpt), "--digests", "--check-finite", "--timeout", "120"])
    print(json.dumps({"fired": fired}), flush=True)
    sys.exit(rc)
try:
    cr.validate_checkpoint(
        ckpt, check_digests=mode in ("digests", "both"), check_finite=mode in ("finite", "both"), timeout_s=120
    )
    out = {"valid": True}
except CheckpointError as exc:
    out = {"reason": exc.reason, "message": str(exc)}
out["fired"] = fired
print(json.dumps(out), flush=True)
"""


def big_sparse_checkpoint(root: Path) -> Path:
    """A valid checkpoint whose one shard is a 100 MiB sparse F32 tensor of zeros."""
    ckpt = publish_checkpoint(root, 1, [("w", torch.zeros(4))], config={"model_type": "x"}, run_id="r").path
    shard = ckpt / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [BIG_ELEMENTS], "data_offsets": [0, 4 * BIG_ELEMENTS]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    with open(shard, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + 4 * BIG_ELEMENTS)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["files"]["model.safetensors"]
    entry["size"], entry["digest"] = shard.stat().st_size, file_digest(shard)
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"].values())
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def run_child(ckpt: Path, mode: str, action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(ckpt), mode, action],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )


def child_result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, (
        f"the validating process died (exit code {proc.returncode}; -7 is SIGBUS): {proc.stderr[-2000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["digests", "finite", "both"])
def test_shard_truncated_mid_scan_is_rejected_not_fatal(tmp_path: Path, mode: str) -> None:
    ckpt = big_sparse_checkpoint(tmp_path)
    size = (ckpt / "model.safetensors").stat().st_size
    out = child_result(run_child(ckpt, mode, "truncate"))
    assert out["fired"] == [size], out  # the file was cut after the scan had started
    assert out.get("reason") == "truncated", out
    assert "step-00000001/model.safetensors" in out["message"], out
    assert "while it was being read" in out["message"] and str(size) in out["message"], out


def test_intact_big_shard_still_validates(tmp_path: Path) -> None:
    ckpt = big_sparse_checkpoint(tmp_path)
    out = child_result(run_child(ckpt, "both", "none"))
    assert out == {"valid": True, "fired": []}


def test_shard_grown_mid_scan_is_rejected(tmp_path: Path) -> None:
    ckpt = big_sparse_checkpoint(tmp_path)
    out = child_result(run_child(ckpt, "finite", "append"))
    assert out["fired"], out
    assert out.get("reason") == "size_mismatch", out
    assert "grew while it was being read" in out["message"], out


def test_cli_validate_reports_truncated_mid_scan_as_invalid(tmp_path: Path) -> None:
    ckpt = big_sparse_checkpoint(tmp_path)
    proc = run_child(ckpt, "cli", "truncate")
    assert proc.returncode == 1, f"exit code {proc.returncode} (-7 is SIGBUS): {proc.stderr[-2000:]}"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["fired"], proc.stdout
    assert "INVALID (truncated)" in proc.stderr and "step-00000001/model.safetensors" in proc.stderr, proc.stderr


def write_raw_safetensors(path: Path, tensors: list[tuple[str, str, np.ndarray]]) -> None:
    """A safetensors file with the tensors' bytes packed in this order, with no alignment."""
    header, blobs, offset = {}, [], 0
    for name, tag, array in tensors:
        blob = array.tobytes()
        header[name] = {"dtype": tag, "shape": [array.size], "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def nan_tensors() -> list[tuple[str, str, np.ndarray]]:
    """Floating tensors of every dtype with 4 NaN/Inf each at odd places; a U8 tensor of odd
    length before each, so most start at offsets that are no multiple of their element size."""
    rng = np.random.default_rng(0)
    out: list[tuple[str, str, np.ndarray]] = []
    bf16 = np.zeros(777, dtype=np.uint16)
    bf16[[0, 5, 400, 776]] = [0x7F80, 0xFF80, 0x7FC1, 0xFFFF]  # bf16 +Inf, -Inf, NaN, NaN
    f8 = np.full(333, 0x38, dtype=np.uint8)
    f8[[1, 2, 100, 332]] = [0x7F, 0xFF, 0x7F, 0xFF]  # F8_E4M3 NaN
    out += [("p_pad", "U8", np.zeros(3, np.uint8)), ("z_bf16", "BF16", bf16)]
    for i, (tag, dtype) in enumerate([("F64", np.float64), ("F32", np.float32), ("F16", np.float16)]):
        a = rng.standard_normal(1000 + 7 * i).astype(dtype)
        a[[0, 1 + 13 * i, len(a) // 2, len(a) - 1]] = [np.nan, np.inf, -np.inf, np.nan]
        out += [(f"t{i}_pad", "U8", np.zeros(3 + 2 * i, np.uint8)), (f"t{i}", tag, a)]
    out += [("u_pad", "U8", np.zeros(5, np.uint8)), ("y_f8", "F8_E4M3", f8)]
    out += [("v_pad", "U8", np.zeros(1, np.uint8)), ("w_ok", "F32", rng.standard_normal(999).astype(np.float32))]
    return out


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 4099, 1 << 20])
def test_finite_check_counts_elements_that_straddle_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(cr, "_READ_CHUNK", chunk, raising=False)
    tensors = nan_tensors()
    path = tmp_path / "model.safetensors"
    write_raw_safetensors(path, tensors)
    with pytest.raises(CheckpointError) as info:
        read_every_byte(tmp_path, path, "x/model.safetensors", file_digest(path), True, True, NO_DEADLINE)
    assert info.value.reason == "non_finite"
    assert "tensor t0 holds 4 NaN/Inf" in str(info.value)
    # every floating tensor, alone among the others' bytes, is counted whole across chunk cuts
    for name, tag, _ in tensors:
        if tag == "U8" or name == "w_ok":
            continue
        only = [(n, t if n == name else "U8", a if n == name else a.view(np.uint8)) for n, t, a in tensors]
        single = tmp_path / f"{name}.safetensors"
        write_raw_safetensors(single, only)
        with pytest.raises(CheckpointError, match=f"tensor {name} holds 4 NaN/Inf"):
            read_every_byte(tmp_path, single, f"x/{name}", "", False, True, NO_DEADLINE)
    finite = tmp_path / "finite.safetensors"
    write_raw_safetensors(finite, [(n, t, a) if n == "w_ok" else (n, "U8", a.view(np.uint8)) for n, t, a in tensors])
    read_every_byte(tmp_path, finite, "x/finite", file_digest(finite), True, True, NO_DEADLINE)


def test_headers_are_parsed_from_a_private_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors maps the file it opens and parses the header from the map: given a root file,
    a truncation during the parse (a large header takes a while) is a SIGBUS. It only ever gets
    a private copy of the header, which nobody else can truncate."""
    ckpt = publish_checkpoint(tmp_path, 1, [("w", torch.zeros(4))], config={"model_type": "x"}, run_id="r").path
    shard = os.stat(ckpt / "model.safetensors")
    opened: list[os.stat_result] = []
    real_safe_open = cr.safe_open

    def spy(path: str, *args: Any, **kw: Any) -> Any:
        opened.append(os.stat(path))
        return real_safe_open(path, *args, **kw)

    monkeypatch.setattr(cr, "safe_open", spy)
    report = validate_checkpoint(ckpt, check_digests=True, check_finite=True)
    assert report.specs == {"w": ("F32", (4,))}
    assert opened and all((st.st_dev, st.st_ino) != (shard.st_dev, shard.st_ino) for st in opened)
    assert all(st.st_size == shard.st_size for st in opened)  # the copy keeps the size the header must cover
    with pytest.raises(CheckpointError) as info:  # and a header that does not cover it still fails
        os.truncate(ckpt / "model.safetensors", shard.st_size - 1)
        cr.read_safetensors_specs(ckpt / "model.safetensors")
    assert info.value.reason == "header_invalid"
