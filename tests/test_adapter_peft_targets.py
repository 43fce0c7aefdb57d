"""PEFT configs whose ``target_modules`` differ from the modules their tensors change, on the tiny
model: the trainer judges the adapter as it is published, as every sidecar will.

A target module the model lacks (PEFT skips it) is left out of the published config, which then
agrees with the manifest: the sidecar serves the adapter. A module left out of some blocks only
(``exclude_modules``) is one SGLang cannot stack: the trainer's start-up check finds it in the
state dict with the sidecar's own tensor checks and syncs merged, saying why, instead of
publishing adapters every sidecar rejects (which ended the training with ``CheckpointRejected``).

SGLang is a scripted /server_info (`fake_sglang.CannedServer`, the LoRA limits a `serve --lora`
SGLang reports), so these run without a server: what they check is the trainer's own judgment of
the adapter, which reads nothing else from SGLang. The fallback to merged sync in real runs
through `serve --lora` is test_lora_grpo.py::test_adapters_sglang_cannot_serve_fall_back_to_merged_sync_with_the_reason.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from fake_sglang import CannedServer, canned_reply
from rollout_service.adapter_reader import LoraLimits, validate_adapter
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import ADAPTER_CONFIG_NAME
from rollout_service.checkpoint_reader import read_model_specs
from trainer_hooks.adapter_publish import adapter_sync_problem, choose_adapter_sync, peft_adapter_config

ALL = LoraLimits(enabled=True, max_rank=64, target_modules=frozenset({"all"}))


@pytest.fixture
def lora_server_info() -> Iterator[CannedServer]:
    """A scripted SGLang ``/server_info`` (no server behind it) that serves LoRA on every module it
    supports. Not named ``lora_server``: conftest marks tests using that fixture name slow."""
    info = {"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": ["all"]}
    server = CannedServer(lambda path, body, count: canned_reply(200, info) if path == "/server_info" else None)
    yield server
    server.stop()


def peft_model(model_dir: Path, **lora: Any) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **lora))


def test_a_target_module_the_model_lacks_is_left_out_of_the_published_config(
    tiny_model_dir: Path, tmp_path: Path, lora_server_info: CannedServer
) -> None:
    model = peft_model(tiny_model_dir, target_modules=["q_proj", "v_proj", "c_attn"])
    config = peft_adapter_config(model)
    assert config is not None and "c_attn" in config["target_modules"]
    assert adapter_sync_problem(model, None, [lora_server_info.url], None) is None
    state = {name: t.detach() for name, t in get_peft_model_state_dict(model).items()}
    step = publish_adapter(tmp_path, 1, state, config, run_id="run1").path
    assert json.loads((step / ADAPTER_CONFIG_NAME).read_text())["target_modules"] == ["q_proj", "v_proj"]
    report = validate_adapter(
        step, root=tmp_path, reference=read_model_specs(tiny_model_dir), limits=ALL, check_finite=True
    )
    assert report.modules == ["q_proj", "v_proj"]


def test_a_target_left_out_of_some_blocks_syncs_merged_with_the_reason(
    tiny_model_dir: Path, lora_server_info: CannedServer, caplog: pytest.LogCaptureFixture
) -> None:
    model = peft_model(
        tiny_model_dir, target_modules=["q_proj", "v_proj"], exclude_modules=r".*layers\.0\.self_attn\.v_proj"
    )
    problem = adapter_sync_problem(model, None, [lora_server_info.url], None)
    assert problem is not None and "bad_adapter" in problem, problem
    assert "model.layers.0.self_attn is adapted in ['q_proj'] but not in ['v_proj']" in problem, problem
    args = types.SimpleNamespace(adapter_sync=True, sglang_urls=[lora_server_info.url], sglang_api_token=None)
    caplog.set_level(logging.INFO, logger="trainer_hooks")
    assert choose_adapter_sync(None, model, None, args, "bfloat16") is None
    lines = [r.getMessage() for r in caplog.records if "LoRA adapter sync is not possible" in r.getMessage()]
    assert len(lines) == 1 and "but not in ['v_proj']" in lines[0], lines


@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": ["q_proj", "v_proj"]},
        {"target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]},
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0]},  # whole blocks, some layers
    ],
    ids=["q-v", "attention-and-mlp", "one-layer"],
)
def test_adapters_the_sidecars_serve_still_sync_as_adapters(
    tiny_model_dir: Path, lora_server_info: CannedServer, lora: dict[str, Any]
) -> None:
    assert (
        adapter_sync_problem(peft_model(tiny_model_dir, **lora), None, [lora_server_info.url], None, "bfloat16") is None
    )


@pytest.mark.parametrize(
    "served,targets",
    [
        (["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]),
        (["qkv_proj"], ["q_proj", "v_proj"]),
        (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj"]),
        (["gate_up_proj", "q_proj", "v_proj"], ["q_proj", "v_proj", "gate_proj", "up_proj"]),
    ],
    ids=["fused-names", "qkv-for-q-v", "k-by-q-v", "gate-up"],
)
def test_target_modules_are_checked_as_sglang_checks_them_by_fused_layer(served: list[str], targets: list[str]) -> None:
    """SGLang compares an adapter's ``target_modules`` with its ``--lora-target-modules`` by the
    layer each module is fused into (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``, ``gate_proj``/
    ``up_proj`` -> ``gate_up_proj``), on both sides: a server started with the fused names, or with
    ``q_proj v_proj``, serves these adapters, which were refused (the run synced merged models)."""
    from rollout_service.adapter_reader import LoraLimits, adapter_support_problem

    limits = LoraLimits(enabled=True, max_rank=16, target_modules=frozenset(served))
    config = {"r": 8, "lora_alpha": 16, "target_modules": targets, "peft_type": "LORA"}
    assert adapter_support_problem(config, limits) is None
    fewer = LoraLimits(enabled=True, max_rank=16, target_modules=frozenset({"o_proj"}))
    assert "not among the server's --lora-target-modules" in str(adapter_support_problem(config, fewer))


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_an_fsdp_run_is_judged_sharded_before_prepare_shards_it(
    tiny_model_dir: Path, lora_server_info: CannedServer, fsdp_version: int
) -> None:
    """Adapter sync is chosen when the trainer is built, before ``accelerator.prepare`` wraps or
    shards the model: the modules showed nothing, adapter sync was chosen, and the first sync
    failed on the sharded adapter (FSDP2: ".numpy() is not supported for tensor subclasses").
    accelerate's FSDP plugin says it will be sharded."""
    model = peft_model(tiny_model_dir, target_modules=["q_proj", "v_proj"])
    plugin = types.SimpleNamespace(fsdp_version=fsdp_version)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=plugin))
    problem = adapter_sync_problem(model, accelerator, [lora_server_info.url], None)
    assert problem is not None and "sharded" in problem and "FSDP" in problem
    assert adapter_sync_problem(model, None, [lora_server_info.url], None) is None  # unsharded: adapter sync


@pytest.mark.parametrize(("served", "named"), [("7", True), (7, True), ("default", False), (None, False)])
def test_a_server_on_a_full_checkpoint_gets_merged_syncs_saying_why(tiny_model_dir: Path, served, named) -> None:
    """SGLang that serves a full checkpoint (an earlier run's merged sync) refuses every adapter
    until it restarts on its base: adapter sync then waited out sync_timeout at every sync."""
    info = {"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": ["all"]}

    def answer(path: str, body: Any, count: int) -> Any:
        if path == "/server_info":
            return canned_reply(200, info)
        if path == "/model_info":
            return canned_reply(200, {"weight_version": served, "model_path": "/m"})
        return None

    server = CannedServer(answer)
    try:
        problem = adapter_sync_problem(peft_model(tiny_model_dir), None, [server.url], None)
    finally:
        server.stop()
    if named:
        assert problem is not None and "serves the full checkpoint version 7" in problem, problem
        assert "restart SGLang on its base model" in problem
    else:
        assert problem is None, problem


def test_a_server_that_does_not_say_its_largest_rank_gets_merged_syncs(tiny_model_dir: Path) -> None:
    """SGLang started with --lora-paths and no --max-lora-rank takes the largest rank of those
    adapters and reports none: an adapter above it was refused at the first sync, ending training."""
    info = {"enable_lora": True, "max_lora_rank": None, "lora_target_modules": ["all"], "lora_paths": ["a=/x"]}
    server = CannedServer(lambda path, body, count: canned_reply(200, info) if path == "/server_info" else None)
    try:
        problem = adapter_sync_problem(peft_model(tiny_model_dir), None, [server.url], None)
    finally:
        server.stop()
    assert problem is not None and "--max-lora-rank" in problem, problem
