"""Adapter sync cases a review found passing or failing wrongly, each now judged as it should be:
PEFT options that train another model than SGLang serves (an initialization that rewrites the base
weights, aLoRA), adapters ``publish_adapter`` wrote and every reader refused (an alpha out of the
manifest's range, a module inside an ``nn.Sequential``), an adapter step whose manifest names a
source of its own (``extra.reconstructed_from``), and SGLang loading an adapter again by itself
between the sidecar's unload and load of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file

from rollout_service.adapter_reader import LoraLimits, adapter_support_problem
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import Manifest
from rollout_service.checkpoint_reader import PublishedCheckpoint
from rollout_service.checkpoint_writer import PublishRefused
from rollout_service.protocol import adapter_name_for
from rollout_service.sidecar import adapter_sync
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.sglang_client import SGLangLoadRejected
from test_adapter_checkpoints import LIMITS, REFERENCE, lora_config, lora_tensors, publish, rejected
from test_adapter_sync_robustness import RUN_ID, LoraSGLang, passes, running, until
from trainer_hooks.adapter_publish import published_adapter_problem

ALL = LoraLimits(True, 16, frozenset({"all"}))


# --- PEFT options that change the trained model -----------------------------------------------
class Attention(torch.nn.Module):
    """The q/v projections SGLang stacks, in a block of their own (``attn``), as in a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 16, bias=False)
        self.v_proj = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.v_proj(x)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False))  # module "mlp.0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


def peft_tiny(**lora: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """A PEFT model of :class:`Tiny`, and q_proj's weight before PEFT saw it (what SGLang serves)."""
    torch.manual_seed(0)
    model = Tiny()
    served = model.attn.q_proj.weight.detach().clone()
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora}
    return get_peft_model(model, LoraConfig(**lora)), served


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_an_initialization_that_rewrites_the_base_weights_syncs_merged(init: str) -> None:
    """PiSSA and OLoRA subtract the adapter's starting product from the base weights: the trainer
    trains on another base than SGLang serves, so base + adapter is not the trained model."""
    peft_model, served = peft_tiny(init_lora_weights=init)
    trained_base = peft_model.base_model.model.attn.q_proj.base_layer.weight
    assert not torch.equal(trained_base, served), "PEFT no longer changes the base weights: revisit the rule"
    problem = adapter_support_problem(peft_model.peft_config["default"].to_dict(), LIMITS)
    assert problem is not None and f"init_lora_weights={init!r}" in problem, problem


@pytest.mark.parametrize("init", [True, False, "gaussian", "Gaussian", "orthogonal", "mica", "MiCA"])
def test_initializations_that_keep_the_base_weights_still_sync_as_adapters(init: bool | str) -> None:
    peft_model, served = peft_tiny(init_lora_weights=init)
    assert torch.equal(peft_model.base_model.model.attn.q_proj.base_layer.weight, served)
    assert adapter_support_problem(peft_model.peft_config["default"].to_dict(), LIMITS) is None


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"init_lora_weights": "corda"}, "init_lora_weights='corda'"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq'"),
        ({"init_lora_weights": "lora_ga"}, "init_lora_weights='lora_ga'"),
        ({"init_lora_weights": None}, "init_lora_weights=None"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"arrow_config": {"top_k": 2}}, "arrow_config"),
        ({"kasa_config": {"beta": 0.1}}, "kasa_config"),
    ],
)
def test_peft_options_sglang_would_serve_as_another_model_have_a_reason(extra: dict, reason: str) -> None:
    problem = adapter_support_problem(lora_config(**extra), LIMITS)
    assert problem is not None and reason in problem, problem


def test_an_eva_initialized_adapter_syncs_as_an_adapter() -> None:
    """EVA sets lora_A from activations once (``initialize_lora_eva_weights``, which needs data) and
    leaves the base weights alone; without the option a config counts as PEFT's default (True)."""
    assert adapter_support_problem(lora_config(init_lora_weights="eva"), LIMITS) is None
    assert "init_lora_weights" not in lora_config() and adapter_support_problem(lora_config(), LIMITS) is None


def test_alora_from_peft_itself_syncs_merged() -> None:
    """aLoRA applies the adapter only after its invocation tokens; SGLang applies it to every token."""
    peft_model, _ = peft_tiny(alora_invocation_tokens=[5, 6])
    problem = adapter_support_problem(peft_model.peft_config["default"].to_dict(), LIMITS)
    assert problem is not None and "alora_invocation_tokens" in problem, problem


def test_a_published_pissa_adapter_is_rejected_by_the_sidecar(tmp_path: Path) -> None:
    publish(tmp_path, init_lora_weights="pissa")
    error = rejected(tmp_path)
    assert error.reason == "adapter_unservable" and "init_lora_weights" in str(error), error


# --- adapters every reader would refuse are not published ------------------------------------
SEQUENTIAL = {  # PEFT's names for a LoRA on a Linear inside nn.Sequential "fc": module "0"
    "base_model.model.model.layers.0.mlp.fc.0.lora_A.weight": torch.randn(4, 16),
    "base_model.model.model.layers.0.mlp.fc.0.lora_B.weight": torch.randn(16, 4),
}


@pytest.mark.parametrize(
    ("tensors", "config", "rule", "says"),
    [
        (lora_tensors(), lora_config(lora_alpha=1e6), "adapter_manifest", "adapter.alpha"),
        (lora_tensors(), lora_config(lora_alpha=0), "adapter_manifest", "adapter.alpha"),
        (lora_tensors(), {**lora_config(), "r": 4.5}, "adapter_config", "r=4.5"),
        (SEQUENTIAL, lora_config(modules=("fc.0",)), "target_modules", "nn.Sequential"),
    ],
)
def test_an_adapter_every_reader_would_refuse_is_not_published(
    tmp_path: Path, tensors: dict, config: dict, rule: str, says: str
) -> None:
    root = tmp_path / "root"
    with pytest.raises(PublishRefused) as info:
        publish_adapter(root, 1, tensors, config, run_id="run1")
    assert info.value.rule == rule and says in str(info.value), info.value
    assert "nothing was published" in str(info.value)
    assert not root.exists() or not any(root.iterdir()), "a refused step left something in the root"


def test_a_module_inside_a_sequential_syncs_merged_from_the_start() -> None:
    """The trainer's start-up check applies the writer's rules: an adapter whose every version
    would be refused syncs merged, with the reason, also where the server takes any module."""
    peft_model, _ = peft_tiny(target_modules=["q_proj", "v_proj", "mlp.0"])
    config = peft_model.peft_config["default"].to_dict()
    problem = adapter_support_problem(config, ALL)
    assert problem is not None and "nn.Sequential" in problem, problem
    problem = published_adapter_problem(peft_model, config, None, [("http://replica", ALL)])
    assert problem is not None and "['0']" in problem and "nn.Sequential" in problem, problem


def test_adapters_readers_accept_are_still_published(tmp_path: Path) -> None:
    peft_model, _ = peft_tiny()
    config = peft_model.peft_config["default"].to_dict()
    assert published_adapter_problem(peft_model, config, None, [("http://replica", ALL)]) is None
    result = publish_adapter(tmp_path, 1, lora_tensors(), lora_config(lora_alpha=999_999.5), run_id="run1")
    assert Manifest.load(result.path).adapter.alpha == 999_999.5


# --- a manifest that names a source of its own ------------------------------------------------
@pytest.fixture
def fake_sglang() -> Iterator[LoraSGLang]:
    fake = LoraSGLang()
    yield fake
    fake.server.stop()


def sidecar_for(fake: LoraSGLang, root: Path, tmp_path: Path, *, stage: bool) -> SyncController:
    """A sync loop (not started) beside the fake SGLang, with or without a stage."""
    base = tmp_path / "base"
    if not base.exists():
        base.mkdir()
        save_file({name: torch.zeros(shape) for name, (_, shape) in REFERENCE.items()}, str(base / "model.safetensors"))
    settings = SidecarSettings(
        checkpoint_path=root,
        sglang_url=fake.url,
        replica_id="review",
        stage=stage,
        stage_dir=tmp_path / "stage" if stage else None,
        reference_dir=base,
        health_interval_s=0.05,
        request_timeout_s=5.0,
        load_timeout_s=5.0,
    )
    return SyncController(settings)


@pytest.mark.parametrize("stage", [True, False], ids=["stage", "no-stage"])
def test_an_adapter_whose_manifest_names_a_source_is_served_and_stays_the_same(
    fake_sglang: LoraSGLang, checkpoint_root: Path, tmp_path: Path, stage: bool
) -> None:
    """(Fake SGLang, see :class:`LoraSGLang`.) ``extra.reconstructed_from`` is free-form to readers:
    the served step is still recorded by its publication's fingerprint, as a full step is, so it
    is neither rejected as changed while staging nor taken for republished at every pass."""
    step = publish(checkpoint_root, step=7).path
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["extra"] = {"reconstructed_from": {"fingerprint": "0" * 32, "kind": "full"}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    published = Manifest.load(step, root=checkpoint_root).fingerprint()
    name = adapter_name_for(7, RUN_ID)
    controller = sidecar_for(fake_sglang, checkpoint_root, tmp_path, stage=stage)

    async def scenario() -> None:
        async with running(controller):
            await until(
                lambda: controller.state.loaded_step == 7 or 7 in controller.state.rejected,
                "step 7 was neither loaded nor rejected",
            )
            assert controller.state.rejected == {}, controller.state.last_error
            await passes(controller, 3)
            assert controller.state.loaded_fingerprint == published
            assert controller._loaded_presence() == "same"
            assert controller.state.loaded_current
            assert fake_sglang.loads == [name], fake_sglang.loads

    asyncio.run(scenario())


# --- SGLang loading an unloaded adapter again by itself ---------------------------------------
class ReloadingSGLang:
    """An in-process fake of SGLang 0.5.23's adapter registry, as the sidecar's client sees it.

    Fake because the race cannot be made on demand with a real server: a request naming an
    adapter that arrives while the sidecar unloads it makes SGLang load it again by itself from
    the path it last loaded it from (``tokenizer_manager._resolve_lora_path``, ``lora_ref_cache``
    is never emptied by an unload), before the sidecar's own load, which SGLang then refuses
    with its real message ("... because it is already loaded")."""

    def __init__(self, loaded: dict[str, str], reloads: int = 1_000_000) -> None:
        self.registry = dict(loaded)
        self.cache = dict(loaded)
        self.calls: list[tuple[str, str]] = []
        self.reloads = reloads
        """How many unloads a request races (puts the adapter back before the sidecar's load)."""

    async def loaded_adapters(self) -> dict[str, str | None]:
        return dict(self.registry)

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        self.calls.append(("load", name))
        if name in self.registry:
            raise SGLangLoadRejected(f"Failed to load LoRA adapter {name} because it is already loaded")
        self.registry[name] = self.cache[name] = path
        return {"success": True}

    async def unload_lora_adapter(self, name: str) -> dict:
        self.calls.append(("unload", name))
        del self.registry[name]
        if not name.endswith(".trial") and self.reloads > 0:  # a rollout named it meanwhile
            self.reloads -= 1
            self.registry[name] = self.cache[name]
            self.calls.append(("reloaded by SGLang", name))
        return {"success": True}


@pytest.mark.parametrize(
    ("cached", "reloads", "loads"), [("same", 1, True), ("other", 1, True), ("other", 1_000_000, None)]
)
def test_an_adapter_sglang_loaded_again_during_its_replacement(
    tmp_path: Path, cached: str, reloads: int, loads: bool | None
) -> None:
    """A sidecar restarted beside a live SGLang replaces the adapter it serves (unload, load). When
    a request put it back in between from the same path, SGLang serves what the load would have:
    the step is loaded, not rejected. From another path (older files) the old files are unloaded
    again and the new ones loaded; when requests keep putting them back, the step is not rejected
    (its files loaded fine under the trial name) but tried again at the next pass (None: the pass
    ends, no older step is tried meanwhile)."""
    root = tmp_path / "root"
    root.mkdir()
    path = str(root / "step-00000007")
    name = adapter_name_for(7, RUN_ID)
    fake = ReloadingSGLang({name: path if cached == "same" else str(tmp_path / "stage" / "older-copy")}, reloads)
    settings = SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", replica_id="review", stage=False)
    controller = SyncController(settings, client=fake)  # type: ignore[arg-type]
    ckpt = PublishedCheckpoint(step=7, path=Path(path))

    async def load() -> bool | None:
        return await controller.adapters._load(ckpt, name, path, "f" * 32)

    assert asyncio.run(load()) is loads
    assert ("reloaded by SGLang", name) in fake.calls, fake.calls
    assert controller.state.rejected == {}
    if loads:
        assert fake.registry[name] == path
    else:
        assert controller.state.last_error is not None
        assert controller.state.last_error["reason"] == "adapter_replace_raced", controller.state.last_error
        assert fake.calls.count(("unload", name)) == adapter_sync.REPLACE_TRIES
