"""With ``--no-stage``, a restarted sidecar never learns the served model's tensors from the root.

SGLang then serves a step folder of the checkpoint root itself (``/model_info``'s ``model_path``).
The root is untrusted and mutable: what is published under that name now need not be what SGLang
loaded. Learnt from it, a step republished with a resized embedding (64x16 where SGLang holds
32x16) became the reference, and the next 64x16 step passed validation; SGLang's load of it raises
(in 0.5.23 a shape mismatch kills the scheduler). The reference comes instead from the model SGLang
was started from (``/server_info``'s ``model_path``: its launch arguments; a weight update moves
only ``/model_info``'s), or ``--reference-dir``; a launch model inside the root is refused with a
warning naming ``--reference-dir``.

SGLang here is a fake: ``fake_sglang.CannedServer`` answers ``/health``, ``/model_info``,
``/server_info`` and ``/update_weights_from_disk`` as SGLang 0.5.23 does, because a real server
cannot be made cheaply to serve a step folder that was then republished (it would need a real
load of a step, then a sidecar restart). The sidecar's own client (``SGLangClient``), sync loop
and validation are the real ones. The last test runs the same attack on a real SGLang (slow).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fake_sglang import CannedServer, canned_reply
from rollout_service.checkpoint_format import CheckpointError, step_dir_name
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar import served_model
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.served_model import find_reference
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.sglang_client import ServerView, SGLangClient
from rollout_service.sidecar.staging import Stage
from sidecar_helpers import run_loop_until

CONFIG = {"model_type": "qwen2"}
SERVED = {"model.embed_tokens.weight": ("F32", (32, 16)), "model.norm.weight": ("F32", (16,))}
"""The tensors SGLang holds: those of the model it was started from."""


def state(rows: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(rows, 16, generator=g), "model.norm.weight": torch.ones(16)}


def publish(root: Path, step: int, rows: int = 32) -> Path:
    return publish_checkpoint(root, step, state(rows, step).items(), config=CONFIG).path


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the warnings :func:`find_reference` logs once per process."""
    monkeypatch.setattr(served_model, "_warned", set(), raising=False)


@pytest.fixture
def base_model(tmp_path: Path) -> Path:
    """The model SGLang was started from: a folder outside the checkpoint root."""
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    save_file(state(), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpts"
    folder.mkdir()
    return folder


def republished_step_5(root: Path) -> Path:
    """Step 5 as SGLang loaded it (32x16), then republished by a writer of the root as 64x16."""
    path = publish(root, 5)
    shutil.rmtree(path)
    assert publish(root, 5, rows=64) == path
    return path


# --- find_reference --------------------------------------------------------------------------


def test_a_republished_served_step_is_not_the_reference_the_launch_model_is(root: Path, base_model: Path) -> None:
    served = republished_step_5(root)
    view = ServerView(True, "5", str(served), launch_model_path=str(base_model))
    found = find_reference(view, root, None, None)
    assert found is not None
    specs, source = found
    assert specs == SERVED, "the reference must be SGLang's model, not what the root holds now"
    assert str(base_model) in source and "started from" in source
    with pytest.raises(CheckpointError) as caught:  # the next step of the republished shapes is refused
        validate_checkpoint(publish(root, 6, rows=64), root=root, reference=specs, allow_float_cast=True)
    assert caught.value.reason == "shape_mismatch"
    assert validate_checkpoint(publish(root, 7), root=root, reference=specs, allow_float_cast=True)


def test_without_the_launch_model_a_served_root_step_gives_no_reference(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang's ``/server_info`` did not answer (or named no model): the step folder SGLang serves
    is still no source; nothing is learnt, and the warning names ``--reference-dir``."""
    served = republished_step_5(root)
    with caplog.at_level(logging.WARNING, logger=served_model.__name__):
        assert find_reference(ServerView(True, "5", str(served)), root, None, None) is None
    assert "--reference-dir" in caplog.text and "/server_info" in caplog.text


@pytest.mark.parametrize("launched_from", ["a-published-step", "a-model-folder"])
def test_a_launch_model_inside_the_root_is_refused_naming_reference_dir(
    root: Path, base_model: Path, launched_from: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang started from a published step, or from a base model kept under the root: that folder
    may have changed since SGLang read it, so it is no reference either; ``--reference-dir`` is
    asked for, once, however often the loop tries again."""
    if launched_from == "a-published-step":
        launched = publish(root, 1)
    else:
        launched = root / "base-model"
        shutil.copytree(base_model, launched)
    republished_step_5(root)
    for model_path in (str(launched), str(root / step_dir_name(5))):  # never updated, then updated
        view = ServerView(True, None, model_path, launch_model_path=str(launched))
        with caplog.at_level(logging.WARNING, logger=served_model.__name__):
            assert find_reference(view, root, None, None) is None
            assert find_reference(view, root, None, None) is None
    warnings = [r.getMessage() for r in caplog.records if "--reference-dir" in r.getMessage()]
    assert len(warnings) == 1 and str(launched) in warnings[0] and "checkpoint root" in warnings[0], warnings


def test_reference_dir_still_comes_first(root: Path, base_model: Path) -> None:
    """(Unchanged: ``--reference-dir`` wins over SGLang's answers, even a launch model in the root.)"""
    launched = publish(root, 1)
    view = ServerView(True, "1", str(launched), launch_model_path=str(launched))
    assert find_reference(view, root, None, base_model) == (SERVED, str(base_model))


def test_a_fresh_stage_beside_a_served_root_step_learns_the_launch_model_and_keeps_it(
    root: Path, base_model: Path, tmp_path: Path
) -> None:
    """A sidecar that ran with ``--no-stage`` restarted with a stage: its stage keeps no reference
    yet, so the served root step was read; now the launch model is, and the stage's reference
    (once kept) is used as before."""
    served = republished_step_5(root)
    stage = Stage(tmp_path / "stage")
    try:
        view = ServerView(True, "5", str(served), launch_model_path=str(base_model))
        found = find_reference(view, root, stage, None)
        assert found is not None and found[0] == SERVED
        stage.save_reference(*found)
        assert find_reference(ServerView(True, "5", str(served)), root, stage, None) == found
    finally:
        stage.close()


# --- SGLang's client ---------------------------------------------------------------------------


class FakeSGLang:
    """A fake SGLang 0.5.23 over HTTP (``CannedServer``): started from ``launch``, serving
    ``model_path`` at ``version``; ``/update_weights_from_disk`` is recorded and succeeds."""

    def __init__(self, launch: str, model_path: str, version: str | None) -> None:
        self.launch, self.model_path, self.version = launch, model_path, version
        self.server_info_answers = True
        self.loads: list[str] = []
        self.server = CannedServer(self._answer)

    def _answer(self, path: str, body: Any, count: int) -> Any:
        if path == "/model_info":
            return canned_reply(200, {"model_path": self.model_path, "weight_version": self.version})
        if path == "/server_info":
            if not self.server_info_answers:
                return canned_reply(404, {"detail": "Not Found"})
            return canned_reply(200, {"model_path": self.launch, "revision": None, "enable_lora": False})
        if path == "/update_weights_from_disk":
            self.loads.append(body["model_path"])
            self.model_path, self.version = body["model_path"], body["weight_version"]
            return canned_reply(200, {"success": True, "message": "ok"})
        return None  # /health: 200 {}

    def views(self, *deep: bool) -> list[ServerView]:
        async def go() -> list[ServerView]:
            client = SGLangClient(self.server.url, timeout_s=3.0)
            try:
                return [await client.view(deep=d) for d in deep]
            finally:
                await client.aclose()

        return asyncio.run(go())


@pytest.fixture
def fake_sglang(root: Path, base_model: Path) -> Any:
    fakes: list[FakeSGLang] = []

    def make(
        launch: str | Path = base_model, model_path: str | Path | None = None, version: str | None = None
    ) -> FakeSGLang:
        fake = FakeSGLang(str(launch), str(model_path or launch), version)
        fakes.append(fake)
        return fake

    yield make
    for fake in fakes:
        fake.server.stop()


def test_the_client_reads_the_launch_model_from_server_info(fake_sglang: Any, root: Path, base_model: Path) -> None:
    fake = fake_sglang(model_path=root / step_dir_name(5), version="5")
    deep, shallow = fake.views(True, False)
    assert deep.model_path == str(root / step_dir_name(5)) and deep.launch_model_path == str(base_model)
    assert shallow.launch_model_path == str(base_model), "kept between deep checks"
    fake.server_info_answers = False
    unknown = fake.views(True)[0]
    assert unknown.healthy and unknown.launch_model_path is None, "/server_info is not health"


def test_one_failed_server_info_keeps_the_launch_model_while_sglang_answers(fake_sglang: Any, base_model: Path) -> None:
    """A /server_info that fails once (a proxy's 5xx, a timeout on a busy CPU) while SGLang
    answers /model_info is no new server: the launch model read before stays (forgetting it left
    a sidecar learning its reference without one until the next deep check, loading nothing);
    SGLang seen down forgets it (it may come back on another model)."""
    fake = fake_sglang()

    async def go() -> list[ServerView]:
        client = SGLangClient(fake.server.url, timeout_s=3.0)
        try:
            seen = [await client.view(deep=True)]
            fake.server_info_answers = False
            seen.append(await client.view(deep=True))
            fake.server.stop()
            seen.append(await client.view(deep=True))
            return seen
        finally:
            await client.aclose()

    first, hiccup, down = asyncio.run(go())
    assert first.launch_model_path == str(base_model)
    assert hiccup.healthy and hiccup.launch_model_path == str(base_model)
    assert not down.healthy and down.launch_model_path is None


def run_sidecar(root: Path, fake: FakeSGLang, done: Any, **overrides: Any) -> SyncController:
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url=fake.server.url,
        replica_id="r0",
        stage=False,
        health_interval_s=0.05,
        poll_interval_s=0.05,
        **overrides,
    )
    controller = SyncController(settings)
    run_loop_until(controller, lambda: done(controller), timeout_s=20)
    return controller


def test_a_restarted_no_stage_sidecar_refuses_a_step_of_the_republished_shapes(
    fake_sglang: Any, root: Path, base_model: Path
) -> None:
    """The whole path: SGLang serves step 5 from the root, step 5 was republished 64x16, step 6 is
    64x16. The sidecar adopts step 5, learns SGLang's model, and rejects step 6 unseen by SGLang."""
    served = republished_step_5(root)
    publish(root, 6, rows=64)
    fake = fake_sglang(model_path=served, version="5")
    controller = run_sidecar(root, fake, lambda c: 6 in c.state.rejected)
    assert controller.state.rejected.get(6) == "shape_mismatch", controller.state.last_error
    assert fake.loads == [], "SGLang must never be given step 6"
    assert str(base_model) in str(controller.state.reference)


def test_a_restarted_no_stage_sidecar_still_loads_a_good_step(fake_sglang: Any, root: Path, base_model: Path) -> None:
    served = republished_step_5(root)
    publish(root, 6)
    fake = fake_sglang(model_path=served, version="5")
    controller = run_sidecar(root, fake, lambda c: c.state.loaded_step == 6)
    assert controller.state.loaded_step == 6 and controller.state.rejected == {}
    assert fake.loads == [str(root / step_dir_name(6))]


def test_sglang_started_from_a_step_of_the_root_loads_nothing_without_reference_dir(
    fake_sglang: Any, root: Path, base_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launched = publish(root, 1)
    shutil.rmtree(launched)
    publish(root, 1, rows=64)  # changed since SGLang read it
    publish(root, 2, rows=64)
    fake = fake_sglang(launch=launched)
    with caplog.at_level(logging.WARNING, logger=served_model.__name__):
        controller = run_sidecar(
            root, fake, lambda c: (c.state.last_error or {}).get("reason") == "no_reference" and len(caplog.records)
        )
    error = controller.state.last_error or {}
    assert controller._reference is None and fake.loads == []
    assert error.get("reason") == "no_reference" and "--reference-dir" in error["message"], error
    assert any("--reference-dir" in r.getMessage() and str(launched) in r.getMessage() for r in caplog.records)
    with_flag = fake_sglang(launch=launched)
    controller = run_sidecar(root, with_flag, lambda c: 2 in c.state.rejected, reference_dir=base_model)
    assert controller.state.rejected.get(2) == "shape_mismatch" and with_flag.loads == []


def test_against_a_real_sglang_a_republished_served_step_does_not_reach_it(
    sglang_server_at_base: Any, sidecar_factory: Any, checkpoint_root: Path, tiny_model_dir: Path
) -> None:
    """The same attack on a real SGLang 0.5.23 (slow): it loads step 1 from the root, its sidecar
    restarts after step 1 was republished with resized embeddings, and step 2 of those shapes
    must be refused, SGLang still healthy (before the fix it was loaded and killed SGLang)."""
    import httpx

    from sidecar_helpers import perturbed_state, publish_step

    def resized(step: int) -> dict[str, torch.Tensor]:
        weights = perturbed_state(tiny_model_dir, step)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] = torch.cat([weights[name], torch.zeros(8, weights[name].shape[1])])
        return weights

    sidecar = sidecar_factory("--no-stage", replica_id="republished")
    step1 = publish_step(checkpoint_root, tiny_model_dir, 1).path
    sidecar.wait_step(1)
    sidecar.stop()
    shutil.rmtree(step1)
    publish_step(checkpoint_root, tiny_model_dir, 1, resized(1))
    again = sidecar_factory("--no-stage", replica_id="republished")
    publish_step(checkpoint_root, tiny_model_dir, 2, resized(2))
    deadline = time.monotonic() + 120
    while "2" not in again.status()["rejected"] and time.monotonic() < deadline:
        time.sleep(0.3)
    status = again.status()
    assert status["rejected"].get("2") == "shape_mismatch", status
    assert str(tiny_model_dir) in status["reference"], status
    sglang_server = sglang_server_at_base
    assert httpx.get(f"{sglang_server.url}/health", timeout=60).status_code == 200
    info = httpx.get(f"{sglang_server.url}/model_info", timeout=30).json()
    assert info["model_path"] == str(step1) and info["weight_version"] == "1", info
    # the session's server back on its own weights: the next test must not find this test's
    # (republished, resized) folder as the path of the weights SGLang serves
    again.stop()
    r = httpx.post(
        f"{sglang_server.url}/update_weights_from_disk",
        json={"model_path": str(tiny_model_dir), "weight_version": "default"},
        timeout=300,
    )
    assert r.status_code == 200 and r.json().get("success"), r.text


def test_a_hub_id_is_no_folder_of_the_root_wherever_the_sidecar_runs(tmp_path: Path, monkeypatch) -> None:
    """SGLang started from a Hub id (``Org/Tiny``): resolved against a working directory inside
    the root it looked like a folder of the root, and nothing was ever learnt (review of session
    26's change). It is looked up in the Hugging Face cache as before."""
    model = tmp_path / "snapshot"
    model.mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(model / "model.safetensors"))
    root = tmp_path / "ckpts"
    root.mkdir()
    looked_up: list[str] = []
    monkeypatch.setattr(served_model, "local_model_dir", lambda name, revision=None: looked_up.append(name) or model)
    monkeypatch.chdir(root)  # e.g. `cd /checkpoints && rollout-service sidecar --checkpoint-path .`
    view = ServerView(healthy=True, model_path="Org/Tiny", launch_model_path="Org/Tiny")
    found = served_model.find_reference(view, Path("."), None, None)
    assert found is not None and found[0] == {"w": ("F32", (2, 2))}, found
    assert looked_up == ["Org/Tiny"]


# --- adopting the step SGLang serves from the root --------------------------------------------


def republished_in_place(root: Path, step: int) -> tuple[Path, str, str]:
    """``step`` as SGLang read it, then republished with other values of the same shapes: the
    path and the fingerprints of both publications."""
    from rollout_service.checkpoint_format import Manifest

    path = publish(root, step)
    before = Manifest.load(path, root=root).fingerprint()
    shutil.rmtree(path)
    publish_checkpoint(root, step, state(32, seed=99).items(), config=CONFIG)
    return path, before, Manifest.load(path, root=root).fingerprint()


def last_ack(root: Path, step: int, fingerprint: str) -> None:
    """What replica r0's ack said before its sidecar restarted."""
    from rollout_service.sidecar.acks import AckWriter

    AckWriter(root, "r0").write_fields({"loaded_step": step, "fingerprint": fingerprint, "ready": True})


def test_a_restarted_no_stage_sidecar_reloads_a_served_step_republished_since(
    fake_sglang: Any, root: Path, base_model: Path
) -> None:
    """SGLang serves step 5 from the root; step 5 was republished (same shapes, other values) while
    no sidecar watched. The folder now holds what SGLang never read: adopting it made /status and
    the ack name the new publication while SGLang served the old weights. It is loaded again."""
    served, before, after = republished_in_place(root, 5)
    last_ack(root, 5, before)
    fake = fake_sglang(model_path=served, version="5")
    controller = run_sidecar(root, fake, lambda c: c.state.loaded_step == 5 and bool(fake.loads))
    assert fake.loads == [str(served)]
    assert controller.state.loaded_fingerprint == after


def test_a_restarted_no_stage_sidecar_without_its_ack_reloads_the_served_step(
    fake_sglang: Any, root: Path, base_model: Path
) -> None:
    """No record of what was sent SGLang (no ack: a new replica id, an emptied acks folder):
    the folder cannot vouch for what SGLang read, so the step is loaded again."""
    served = publish(root, 5)
    fake = fake_sglang(model_path=served, version="5")
    controller = run_sidecar(root, fake, lambda c: c.state.loaded_step == 5 and bool(fake.loads))
    assert fake.loads == [str(served)] and controller.state.loaded_step == 5


def test_a_restarted_no_stage_sidecar_adopts_the_step_its_ack_says_it_served(
    fake_sglang: Any, root: Path, base_model: Path
) -> None:
    """Its ack names this very publication: adopted, no reload."""
    from rollout_service.checkpoint_format import Manifest

    served = publish(root, 5)
    fingerprint = Manifest.load(served, root=root).fingerprint()
    last_ack(root, 5, fingerprint)
    fake = fake_sglang(model_path=served, version="5")
    controller = run_sidecar(root, fake, lambda c: c.state.loaded_step == 5 and c.state.ready)
    assert fake.loads == [] and controller.state.loaded_fingerprint == fingerprint


def test_the_base_model_is_found_once_sglang_restarts_on_it(fake_sglang: Any, root: Path, base_model: Path) -> None:
    """A sidecar that started beside SGLang serving a full step of the root knew no base model
    folder (adapters' recorded base values are compared with it); when SGLang came back on its
    base model it still knew none, and the comparison was skipped for the sidecar's life. It is
    looked for again once SGLang serves its base model."""
    served = publish(root, 5)
    fake = fake_sglang(model_path=served, version="5")

    def restarted_then_found(c: SyncController) -> bool:
        if c.state.loaded_step == 5 and fake.version == "5" and c.base_dir is None:
            fake.model_path, fake.version = str(base_model), "default"  # SGLang restarted on its base
        return c.base_dir is not None

    controller = run_sidecar(root, fake, restarted_then_found)
    assert controller.base_dir == base_model
