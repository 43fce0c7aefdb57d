"""The CLI's publish/validate commands, --help, and the slim sidecar's freedom from torch/SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from helpers import generate
from rollout_service.checkpoint_reader import validate_checkpoint

CLI = [sys.executable, "-m", "rollout_service.cli"]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_publish_validate_load_round_trip_through_the_cli(tiny_model_dir, checkpoint_root, sglang_server):
    out = run_cli(
        "publish", "--model-dir", str(tiny_model_dir), "--checkpoint-path", str(checkpoint_root), "--step", "7"
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    path = Path(info["published"])
    assert path == checkpoint_root / "step-00000007" and info["weight_version"] == "7"
    ok = run_cli("validate", str(path), "--reference", str(tiny_model_dir), "--digests")
    assert ok.returncode == 0, ok.stderr
    assert "digests match" in json.loads(ok.stdout)["checks"]
    again = run_cli(
        "publish", "--model-dir", str(tiny_model_dir), "--checkpoint-path", str(checkpoint_root), "--step", "7"
    )
    assert again.returncode == 2 and "already published" in again.stderr
    # Validated -> loaded by SGLang with that version -> completions say so.
    report = validate_checkpoint(path)
    r = httpx.post(
        f"{sglang_server.url}/update_weights_from_disk",
        json={"model_path": str(report.path), "weight_version": "7"},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    assert generate(sglang_server.url, [1, 2, 3], max_new_tokens=3)["meta_info"]["weight_version"] == "7"
    # A damaged copy: validate names the reason and exits 1.
    (path / "config.json").unlink()
    bad = run_cli("validate", str(path))
    assert bad.returncode == 1 and "INVALID (missing_file)" in bad.stderr


def test_help_explains_every_command():
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("publish", "validate", "sidecar", "serve", "make-tiny-model"):
        assert command in top.stdout
        sub = run_cli(command, "--help")
        assert sub.returncode == 0 and "usage:" in sub.stdout, sub.stderr
    serve = run_cli("serve", "--help").stdout
    assert "ROLLOUT_CHECKPOINT_PATH" in serve and "'--'" in serve


def test_environment_variables_set_flags_and_bad_values_are_named(checkpoint_root):
    env = {"ROLLOUT_CHECKPOINT_PATH": str(checkpoint_root), "ROLLOUT_SGLANG_URL": "ftp://nope", "ROLLOUT_PORT": "1"}
    out = run_cli("sidecar", env=env)
    assert out.returncode == 2 and "--sglang-url must start with http://" in out.stderr
    out = run_cli("sidecar", env={**env, "ROLLOUT_PORT": "eighty"})
    assert out.returncode == 2 and "ROLLOUT_PORT='eighty' is not valid for --port" in out.stderr
    out = run_cli(
        "sidecar", "--sglang-url", "http://127.0.0.1:1", "--checkpoint-path", str(checkpoint_root / "missing")
    )
    assert (
        out.returncode == 2
        and "--checkpoint-path (ROLLOUT_CHECKPOINT_PATH)" in out.stderr
        and "does not exist" in out.stderr
    )
    # An address that would only fail once the sidecar runs is refused at start, without a traceback.
    for url, why in [("http://::1:30000", "IPv6 host in brackets"), ("http://u:pw@127.0.0.1:1", "user name or")]:
        out = run_cli("sidecar", "--sglang-url", url, "--checkpoint-path", str(checkpoint_root))
        assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr, out.stderr


_SLIM = r"""
import sys, importlib.abc

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "sglang", "transformers", "trl"):
            raise ImportError(f"slim sidecar imported {name}")
        return None

sys.meta_path.insert(0, Block())
from rollout_service.sidecar.app import create_app
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service import sglang_launcher, serve
app = create_app(SidecarSettings(checkpoint_path=sys.argv[1], sglang_url="http://127.0.0.1:1"))
print(validate_checkpoint(sys.argv[2], check_digests=True).manifest.step)
"""


def test_sidecar_and_validation_import_without_torch_or_sglang(tiny_model_dir, checkpoint_root):
    from rollout_service.model_dir_source import publish_model_dir

    path = publish_model_dir(tiny_model_dir, checkpoint_root, 3, dtype="bfloat16").path
    out = subprocess.run(
        [sys.executable, "-c", _SLIM, str(checkpoint_root), str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
