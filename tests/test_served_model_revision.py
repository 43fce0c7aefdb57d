"""A Hub id SGLang serves is looked up in the local HF cache at the revision SGLang was started with.

SGLang started on ``org/model --revision v2`` loads the ``v2`` snapshot of its cache. The sidecar
checks every checkpoint against the served model's tensors and compares an adapter's recorded base
values with the served model's files: read from the ``main`` snapshot instead, a checkpoint of the
served model would be refused for its shapes, or an adapter trained on it refused as
``adapter_base_mismatch``. Here a local HF cache holds two snapshots of one repo with different
shapes; SGLang is a stand-in whose ``/server_info`` names the revision (a real SGLang would need
the model downloaded from the Hub, which these machines cannot reach).
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file

from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.served_model import base_model_dir, local_model_dir
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.sglang_client import ServerView, SGLangUnavailable
from sidecar_helpers import run_loop_until

REPO_ID = "org/tiny"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A local HF cache: ``main`` -> a snapshot whose ``w`` has 2 values, ``v2`` -> one with 3."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshots = {}
    for ref, commit, size in (("main", MAIN, 2), ("v2", V2, 3)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        save_file({"w": torch.zeros(size)}, str(snap / "model.safetensors"))
        (snap / "config.json").write_text("{}")
        snapshots[ref] = snap
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return snapshots


def test_a_hub_id_resolves_to_the_snapshot_of_its_revision(hub_cache: dict[str, Path]) -> None:
    assert local_model_dir(REPO_ID) == hub_cache["main"]
    assert local_model_dir(REPO_ID, "v2") == hub_cache["v2"]
    assert local_model_dir(REPO_ID, V2) == hub_cache["v2"]  # a commit
    assert local_model_dir(REPO_ID, "v3") is None  # not in the cache: no reference from it
    view = ServerView(True, None, REPO_ID)
    assert base_model_dir(view, Path("/nonexistent-root"), None, None, "v2") == hub_cache["v2"]


class HubClient:
    """A stand-in for SGLang started on ``org/tiny --revision <revision>`` (``/server_info``
    answers with it; ``fail_info``: it does not answer yet)."""

    def __init__(self, revision: str | None, fail_info: int = 0):
        self.revision = revision
        self.fail_info = fail_info
        self.info_calls = 0

    async def view(self, deep: bool = False) -> ServerView:
        return ServerView(True, None, REPO_ID)

    async def server_info(self) -> dict:
        self.info_calls += 1
        if self.info_calls <= self.fail_info:
            raise SGLangUnavailable("not yet")
        return {"revision": self.revision}

    async def aclose(self) -> None:
        pass


def controller_with(root: Path, client: HubClient) -> SyncController:
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url="http://127.0.0.1:9",
        replica_id="r0",
        health_interval_s=0.05,
        poll_interval_s=0.05,
    )
    return SyncController(settings, client=client)  # type: ignore[arg-type]


@pytest.mark.parametrize(("revision", "expected"), [("v2", "v2"), (None, "main")])
def test_the_sidecar_checks_against_the_snapshot_sglang_was_started_on(
    hub_cache: dict[str, Path], tmp_path: Path, revision: str | None, expected: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    controller = controller_with(root, HubClient(revision, fail_info=2))
    run_loop_until(controller, lambda: controller._reference is not None)
    assert controller._reference == {"w": ("F32", (3 if expected == "v2" else 2,))}
    assert controller.state.reference == str(hub_cache[expected])
    assert controller.base_dir == hub_cache[expected]
