"""``--stage-max-gb``: what the stage may hold, below its file system's room.

Under Kubernetes the stage is an ``emptyDir`` with a ``sizeLimit``, past which the kubelet evicts
the pod: the sidecar sees the node disk's free space, not the limit, so it staged copies until
the pod was evicted. With the limit given (the base manifest sets it under the ``sizeLimit``), a
step that needs more than the limit is rejected (``too_large_for_stage``) and one that needs room
freed first waits (``stage_failed``), as on a full file system. Real files in a real stage folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy_files import K8S_KUSTOMIZATIONS, pod_specs, render_kustomization
from rollout_service.checkpoint_format import CheckpointError
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.staging import SPACE_MARGIN_BYTES, Stage, StageError

MIB = 1 << 20
REQUIRED = ["--checkpoint-path", "/c", "--sglang-url", "http://127.0.0.1:30000"]


def test_a_step_larger_than_the_stage_may_hold_is_rejected(tmp_path: Path) -> None:
    stage = Stage(tmp_path / "stage", max_bytes=100 * MIB)
    with pytest.raises(CheckpointError) as err:
        stage._check_room(3, 50 * MIB)  # 50 MiB and the 64 MiB margin: more than 100 MiB
    assert err.value.reason == "too_large_for_stage" and "--stage-max-gb" in str(err.value)
    Stage(tmp_path / "other", max_bytes=None)._check_room(3, 50 * MIB)  # the disk has room


def test_what_the_stage_holds_counts_against_its_limit(tmp_path: Path) -> None:
    stage = Stage(tmp_path / "stage", max_bytes=200 * MIB)
    held = stage.path / "step-00000001-abcdef012345"
    held.mkdir()
    with open(held / "model.safetensors", "wb") as f:
        f.write(b"\0" * (60 * MIB))  # real bytes: a sparse file would hold none
    stage._check_room(2, 200 * MIB - 60 * MIB - SPACE_MARGIN_BYTES - MIB)  # fits beside it (a MiB spare)
    with pytest.raises(StageError, match="MiB"):
        stage._check_room(2, 80 * MIB)  # 80 + 64 > 200 - 60: wait for room (retried), not rejected


def test_the_setting_reads_gib_from_its_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_service.cli import build_parser

    args = build_parser().parse_args(["sidecar", *REQUIRED, "--stage-max-gb", "1.5"])
    assert args.stage_max_gb == 1.5
    monkeypatch.setenv("ROLLOUT_STAGE_MAX_GB", "2")
    assert build_parser().parse_args(["sidecar", *REQUIRED]).stage_max_gb == 2.0
    assert SidecarSettings.__dataclass_fields__["stage_max_gb"].default is None


def test_the_base_manifest_keeps_the_stage_under_its_volumes_size_limit() -> None:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    checked = 0
    for kustomization in K8S_KUSTOMIZATIONS:
        for where, spec in pod_specs(render_kustomization(kustomization)).items():
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            if "stage" not in volumes:
                continue
            limit = volumes["stage"]["emptyDir"]["sizeLimit"]
            limit_bytes = int(limit[:-2]) * units[limit[-2:]]
            for container in spec["containers"]:
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                if "ROLLOUT_STAGE_DIR" in env:
                    assert float(env["ROLLOUT_STAGE_MAX_GB"]) * (1 << 30) < limit_bytes, where
                    checked += 1
    assert checked == len(K8S_KUSTOMIZATIONS)  # the base, and every overlay keeps it
