"""Adapter checkpoints without a server: publication, strict manifest parsing, validation against
the served model and the server's LoRA limits, the support judgement, the LoRA serving flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import rollout_service.adapter_writer as aw
from rollout_service.adapter_reader import LoraLimits, adapter_support_problem, validate_adapter, validate_adapter_step
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import CheckpointError, Manifest
from rollout_service.lora_serving import LoraServing
from rollout_service.protocol import adapter_name_for, step_for_adapter_name
from test_cli_validate_kinds import vouch_for

HIDDEN, KV, INTER = 16, 8, 32
REFERENCE = {
    "model.layers.0.self_attn.q_proj.weight": ("F32", (HIDDEN, HIDDEN)),
    "model.layers.0.self_attn.k_proj.weight": ("F32", (KV, HIDDEN)),
    "model.layers.0.self_attn.v_proj.weight": ("F32", (KV, HIDDEN)),
    "model.layers.0.mlp.gate_proj.weight": ("F32", (INTER, HIDDEN)),
    "model.layers.0.mlp.up_proj.weight": ("F32", (INTER, HIDDEN)),
}
LIMITS = LoraLimits(
    enabled=True, max_rank=16, target_modules=frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
)


def lora_config(r: int = 4, modules=("q_proj", "v_proj"), **extra) -> dict:
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": set(modules),
        "use_dora": False,
        "modules_to_save": None,
        "use_rslora": False,
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
        **extra,
    }


def lora_tensors(r: int = 4, modules=("q_proj", "v_proj"), seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        name = next(k for k in REFERENCE if f".{m}." in k)
        rows, cols = REFERENCE[name][1]
        prefix = "base_model.model." + name.removesuffix(".weight")
        out[f"{prefix}.lora_A.weight"] = torch.randn(r, cols, generator=g)
        out[f"{prefix}.lora_B.weight"] = torch.randn(rows, r, generator=g)
    return out


def publish(root: Path, step: int = 1, r: int = 4, modules=("q_proj", "v_proj"), tensors=None, **cfg):
    return publish_adapter(
        root,
        step,
        tensors if tensors is not None else lora_tensors(r, modules),
        lora_config(r, modules, **cfg),
        run_id="run1",
    )


def check(root: Path, step: int = 1, limits: LoraLimits = LIMITS):
    return validate_adapter(root / f"step-{step:08d}", root=root, reference=REFERENCE, limits=limits, check_finite=True)


def rejected(root: Path, step: int = 1, limits: LoraLimits = LIMITS) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        check(root, step, limits)
    return info.value


def test_a_published_adapter_is_peft_files_and_a_manifest_that_validates(tmp_path):
    result = publish(tmp_path, modules=("q_proj", "v_proj", "gate_proj"))
    assert result.kind == "adapter"
    assert sorted(p.name for p in result.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]
    config = json.loads((result.path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["target_modules"] == ["gate_proj", "q_proj", "v_proj"]
    manifest = Manifest.load(result.path)
    assert manifest.kind == "adapter" and manifest.adapter.rank == 4 and manifest.adapter.alpha == 8.0
    assert manifest.adapter.target_modules == ["gate_proj", "q_proj", "v_proj"]
    report = check(tmp_path)
    assert report.checks[-1] == "finite" and report.modules == ["gate_proj", "q_proj", "v_proj"]
    with pytest.raises(FileExistsError):
        publish(tmp_path)


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda a: a.update(peft_type="LOHA"), "adapter.peft_type"),
        (lambda a: a.update(rank=0), "adapter.rank"),
        (lambda a: a.update(rank=True), "adapter.rank"),
        (lambda a: a.update(alpha=1e9), "adapter.alpha"),
        (lambda a: a.update(target_modules=["q_proj;rm -rf"]), "adapter.target_modules"),
        (lambda a: a.update(target_modules=[]), "adapter.target_modules"),
        (lambda a: a.update(extra=1), "rank, alpha, target_modules, peft_type and base_values only"),
    ],
)
def test_the_adapter_description_is_parsed_strictly(tmp_path, change, found):
    path = publish(tmp_path).path
    data = json.loads((path / "manifest.json").read_text())
    change(data["adapter"])
    with pytest.raises(CheckpointError, match=found.replace("(", r"\(")) as info:
        Manifest.from_json(json.dumps(data, allow_nan=True))
    assert info.value.reason == "bad_manifest"


def test_an_adapter_field_on_a_full_checkpoint_and_an_adapter_without_one_are_refused(tmp_path):
    data = json.loads((publish(tmp_path).path / "manifest.json").read_text())
    with pytest.raises(CheckpointError, match="a full checkpoint has no adapter field"):
        Manifest.from_json(json.dumps({**data, "kind": "full"}))
    with pytest.raises(CheckpointError, match="adapter must be a JSON object"):
        Manifest.from_json(json.dumps({**data, "adapter": None}))


def test_files_beside_the_adapter_or_of_the_wrong_size_are_rejected(tmp_path):
    path = publish(tmp_path).path
    (path / "adapter_model.bin").write_bytes(b"x")
    assert rejected(tmp_path).reason == "unlisted_file"
    os.unlink(path / "adapter_model.bin")
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    assert rejected(tmp_path).reason == "truncated"


def test_a_link_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    path = publish(root).path
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((path / "adapter_model.safetensors").read_bytes())
    os.unlink(path / "adapter_model.safetensors")
    os.symlink(outside, path / "adapter_model.safetensors")
    assert rejected(root).reason in ("path_escape", "not_a_regular_file", "unreadable")


def test_an_adapter_step_named_link_is_refused_even_to_a_valid_adapter_inside_the_root(tmp_path):
    # As for full and delta steps (a review, session 31): the trainer never counts such a link.
    root = tmp_path / "root"
    os.rename(publish(root, 1).path, root / ".aside")
    os.symlink(".aside", root / "step-00000001")
    error = rejected(root)
    assert error.reason == "not_a_checkpoint" and "symbolic link" in str(error), error


def test_an_adapter_for_another_model_or_with_wrong_shapes_is_rejected_naming_the_tensor(tmp_path):
    tensors = lora_tensors()
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, HIDDEN)
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(HIDDEN, 4)
    publish(tmp_path, 1, tensors=tensors)
    error = rejected(tmp_path, 1)
    assert error.reason == "adapter_mismatch" and "layers.7" in str(error)
    tensors = lora_tensors()
    tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] = torch.zeros(KV + 1, 4)
    publish(tmp_path, 2, tensors=tensors)
    error = rejected(tmp_path, 2)
    assert error.reason == "adapter_mismatch" and "v_proj" in str(error) and f"[{KV}, 4]" in str(error)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float64], ids=str)
@pytest.mark.parametrize("every", [True, False], ids=["every-tensor", "one-tensor"])
def test_lora_weights_of_a_dtype_adapters_are_not_published_in_are_rejected(tmp_path, dtype, every):
    """The writer publishes LoRA weights in ``ADAPTER_DTYPES`` only, because readers reject the
    others; they do (``dtype_unloadable``), also when the manifest vouches for every byte and
    names the dtype, or names none (tensors of mixed dtypes)."""
    path = publish(tmp_path).path
    tensors = lora_tensors()
    changed = sorted(tensors) if every else sorted(tensors)[:1]
    for name in changed:
        tensors[name] = tensors[name].to(dtype)
    vouch_for(path, "adapter_model.safetensors", save(tensors))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["dtype"] = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float64: "F64"}[dtype]
    manifest["dtype"] = manifest["dtype"] if every else None
    (path / "manifest.json").write_text(json.dumps(manifest))
    for error in (rejected(tmp_path), step_rejected(path)):
        assert error.reason == "dtype_unloadable" and repr(changed[0]) in str(error), error
        assert "['F32', 'F16', 'BF16']" in str(error)


def step_rejected(path: Path) -> CheckpointError:
    """The error of ``rollout-service validate`` (no reference model) for the step ``path``."""
    with pytest.raises(CheckpointError) as info:
        validate_adapter_step(path, limits=LIMITS, check_finite=True)
    return info.value


def test_the_writer_publishes_the_dtypes_readers_accept():
    from rollout_service.adapter_reader import ADAPTER_DTYPES

    assert sorted(aw._TAGS.values()) == sorted(ADAPTER_DTYPES)


def test_nan_weights_and_a_config_that_disagrees_with_the_manifest_are_rejected(tmp_path):
    tensors = lora_tensors()
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][0, 0] = float("nan")
    publish_adapter(tmp_path, 1, tensors, lora_config(), run_id="run1", check_finite=False)
    assert rejected(tmp_path, 1).reason == "non_finite"
    path = publish(tmp_path, 2).path
    config = json.loads((path / "adapter_config.json").read_text())
    config["r"] = 8
    text = json.dumps(config)
    (path / "adapter_config.json").write_text(text)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["total_bytes"] += len(text) - manifest["files"]["adapter_config.json"]["size"]
    manifest["files"]["adapter_config.json"]["size"] = len(text)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert rejected(tmp_path, 2).reason == "bad_adapter_config"


def test_an_adapter_above_the_server_rank_or_modules_is_unservable(tmp_path):
    publish(tmp_path, 1, r=32)
    error = rejected(tmp_path, 1)
    assert error.reason == "adapter_unservable" and "--max-lora-rank 16" in str(error)
    publish(tmp_path, 2)
    error = rejected(tmp_path, 2, LoraLimits(True, 64, frozenset({"o_proj"})))
    assert error.reason == "adapter_unservable" and "['q_proj', 'v_proj']" in str(error)
    # (A server started with q_proj serves v_proj too: SGLang checks both by their fused qkv_proj.)
    check(tmp_path, 2, LoraLimits(True, 64, frozenset({"q_proj"})))
    error = rejected(tmp_path, 2, LoraLimits(False, None))
    assert "started without LoRA" in str(error)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (lora_config(use_dora=True), "DoRA"),
        (lora_config(modules_to_save=["lm_head"]), "modules_to_save"),
        (lora_config(use_rslora=True), "use_rslora"),
        (lora_config(rank_pattern={"q_proj": 8}), "rank_pattern"),
        (lora_config(bias="lora_only"), "bias"),
        (lora_config(r=32), "--max-lora-rank 16"),
        (lora_config(modules=("q_proj", "v_proj", "o_proj")), "['o_proj'] are not among"),
        (lora_config(target_modules="all-linear"), "is a pattern"),
        (lora_config(modules=("q_proj",)), "needs q_proj and v_proj"),
        (lora_config(modules=("q_proj", "v_proj", "up_proj")), "up_proj without gate_proj"),
        ({**lora_config(), "peft_type": "IA3"}, "serves LoRA only"),
    ],
)
def test_each_adapter_sglang_cannot_serve_has_its_reason(config, reason):
    problem = adapter_support_problem(config, LIMITS)
    assert problem is not None and reason in problem, problem


def test_servable_adapters_have_no_problem():
    assert adapter_support_problem(lora_config(), LIMITS) is None
    assert adapter_support_problem(lora_config(modules=("q_proj", "k_proj", "v_proj", "gate_proj")), LIMITS) is None
    assert (
        adapter_support_problem(lora_config(modules=("gate_proj", "up_proj")), LoraLimits(True, 16, frozenset({"all"})))
        is None
    )
    # PEFT resolves target_modules="all-linear" to full module paths.
    resolved = lora_config(modules=("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"))
    assert adapter_support_problem(resolved, LIMITS) is None


def test_server_info_gives_the_limits():
    limits = LoraLimits.from_server_info(
        {"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": ["q_proj", "v_proj"]}
    )
    assert limits == LoraLimits(True, 64, frozenset({"q_proj", "v_proj"}))
    assert not LoraLimits.from_server_info({"enable_lora": None}).enabled


def test_adapter_names_are_fresh_per_version_and_name_their_step():
    assert adapter_name_for(42, "run1") == "v00000042-run1" != adapter_name_for(43, "run1")
    assert step_for_adapter_name("v00000042-run1") == 42 and step_for_adapter_name("v00000042") == 42
    for junk in ("default", "v42", "v0000004x-a", "v00000042run", None, 7):
        assert step_for_adapter_name(junk) is None


def test_lora_serving_flags_for_sglang():
    args = LoraServing().sglang_args("cpu")
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "64"] and args[-2:] == ["--lora-backend", "torch_native"]
    assert "--lora-backend" not in LoraServing().sglang_args("cuda")
    with pytest.raises(ValueError, match="max-loras-per-batch"):
        LoraServing(max_loras_per_batch=1)


def test_serve_lora_puts_the_flags_on_sglangs_command_line(tmp_path):
    from rollout_service.cli import build_parser
    from rollout_service.lora_serving import lora_from_args
    from rollout_service.sglang_launcher import SGLangServer

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tmp_path),
            "--checkpoint-path",
            str(tmp_path),
            "--lora",
            "--max-lora-rank",
            "32",
            "--lora-target-modules",
            "q_proj,v_proj",
        ]
    )
    lora = lora_from_args(args)
    assert lora == LoraServing(max_rank=32, target_modules=("q_proj", "v_proj"))
    cmd = SGLangServer(tmp_path, device="cpu", lora=lora).command()
    i = cmd.index("--lora-target-modules")
    assert "--enable-lora" in cmd and cmd[i + 1 : i + 3] == ["q_proj", "v_proj"] and "torch_native" in cmd
    plain = build_parser().parse_args(["serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path)])
    assert lora_from_args(plain) is None


@pytest.mark.sglang  # imports SGLang in a subprocess (seconds)
def test_the_cpu_stand_in_lets_sglangs_lora_modules_create_pinned_buffers():
    from rollout_service.sglang_launcher import CPU_SHIMS_DIR

    code = (
        "import torch, sgl_kernel\n"
        "from sglang.srt.lora import layers\n"
        "t = layers.torch.tensor([1, 2], dtype=torch.int32, device='cpu', pin_memory=True)\n"
        "assert t.tolist() == [1, 2] and torch.ones(2).pin_memory().tolist() == [1.0, 1.0]\n"
        "assert layers.torch is not torch and layers.torch.Tensor is torch.Tensor\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(CPU_SHIMS_DIR), "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    # Without the stand-in the same call fails on this CUDA build of torch (no driver), which is
    # what the shim is for; where torch can pin (a CPU-only build), there is nothing to show.
    bare = subprocess.run(
        [sys.executable, "-c", "import torch; torch.zeros(2, pin_memory=True)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bare.returncode != 0 or not torch.version.cuda


# --- what a load would trip over, found in the tensors and the manifest (review findings) -----
TWO_LAYERS = {
    "model.embed_tokens.weight": ("F32", (64, HIDDEN)),
    **{
        f"model.layers.{i}.{name}": spec
        for i in (0, 1)
        for name, spec in {
            "input_layernorm.weight": ("F32", (HIDDEN,)),
            "self_attn.q_proj.weight": ("F32", (HIDDEN, HIDDEN)),
            "self_attn.k_proj.weight": ("F32", (KV, HIDDEN)),
            "self_attn.v_proj.weight": ("F32", (KV, HIDDEN)),
            "mlp.gate_proj.weight": ("F32", (INTER, HIDDEN)),
            "mlp.up_proj.weight": ("F32", (INTER, HIDDEN)),
        }.items()
    },
}
ALL = LoraLimits(True, 16, frozenset({"all"}))


def two_layer_tensors(per_layer: dict[int, tuple[str, ...]], r: int = 4) -> dict[str, torch.Tensor]:
    """LoRA weights for ``per_layer[i]``'s modules in layer i of :data:`TWO_LAYERS`."""
    out = {}
    for layer, modules in per_layer.items():
        for m in modules:
            name = next(k for k in TWO_LAYERS if k.startswith(f"model.layers.{layer}.") and f".{m}." in k)
            shape = TWO_LAYERS[name][1]
            rows, cols = (tuple(shape) + (0,))[:2]
            prefix = "base_model.model." + name.removesuffix(".weight")
            out[f"{prefix}.lora_A.weight"] = torch.ones(r, cols)
            out[f"{prefix}.lora_B.weight"] = torch.ones(rows, r)
    return out


def two_layer_rejected(root: Path, config_modules, per_layer, limits: LoraLimits = ALL) -> CheckpointError:
    """The error for an adapter of ``per_layer``'s tensors whose config and manifest both say
    ``config_modules`` (another writer's: ``publish_adapter`` writes the tensors' modules)."""
    path = publish_adapter(root, 1, two_layer_tensors(per_layer), lora_config(4, config_modules), run_id="run1").path
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config_modules)
    vouch_for(path, "adapter_config.json", json.dumps(config).encode())
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["adapter"]["target_modules"] = sorted(config_modules)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        validate_adapter(root / "step-00000001", root=root, reference=TWO_LAYERS, limits=limits)
    return info.value


@pytest.mark.parametrize(
    ("config_modules", "per_layer", "missing"),
    [
        # SGLang stacks q/k/v and gate/up per layer from the tensors it finds: one missing makes
        # its scheduler die at the first request, whatever the config says.
        (("q_proj", "k_proj", "v_proj"), {0: ("k_proj",), 1: ("k_proj",)}, "['q_proj', 'v_proj']"),
        (("gate_proj", "up_proj"), {0: ("up_proj",), 1: ("up_proj",)}, "['gate_proj']"),
        (("q_proj", "v_proj"), {0: ("q_proj", "v_proj"), 1: ("q_proj",)}, "['v_proj']"),
        (("q_proj", "k_proj", "v_proj"), {0: ("q_proj", "v_proj"), 1: ("k_proj",)}, "['k_proj']"),
    ],
)
def test_every_adapted_block_holds_every_target_module_the_model_has_there(
    tmp_path, config_modules, per_layer, missing
):
    error = two_layer_rejected(tmp_path, config_modules, per_layer)
    assert error.reason == "bad_adapter" and missing in str(error), error


def test_an_adapter_on_some_layers_only_holds_all_targets_in_those(tmp_path):
    publish_adapter(
        tmp_path, 1, two_layer_tensors({1: ("q_proj", "v_proj")}), lora_config(4, ("q_proj", "v_proj")), run_id="r"
    )
    report = validate_adapter(tmp_path / "step-00000001", root=tmp_path, reference=TWO_LAYERS, limits=ALL)
    assert report.modules == ["q_proj", "v_proj"]


def test_a_module_that_is_not_a_linear_layer_is_refused_even_when_the_server_takes_all(tmp_path):
    error = two_layer_rejected(tmp_path, ("input_layernorm",), {0: ("input_layernorm",), 1: ("input_layernorm",)})
    assert error.reason == "adapter_mismatch" and "not a linear layer" in str(error), error


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (lora_config(modules_to_save=1), "modules_to_save=1"),
        (lora_config(modules_to_save=[1, "a"]), "modules_to_save=[1, 'a']"),
        (lora_config(layer_replication=[[0, 1]]), "layer_replication"),
        (lora_config(use_qalora=True), "use_qalora"),
        (lora_config(lora_bias=True), "lora_bias"),
        (lora_config(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
        (lora_config(trainable_token_indices=[3]), "trainable_token_indices"),
        ({**lora_config(), "target_modules": [None, "q_proj", "v_proj"]}, "not a list of module names"),
        ({**lora_config(), "target_modules": []}, "not a list of module names"),
        ({**lora_config(), "lora_alpha": True}, "lora_alpha"),
        ({**lora_config(), "lora_alpha": float("inf")}, "lora_alpha"),
        (lora_config(modules=("embed_tokens", "q_proj", "v_proj")), "linear layers inside the model"),
        (lora_config(modules=("lm_head",)), "linear layers inside the model"),
    ],
)
def test_configs_sglang_would_serve_as_another_model_have_a_reason_not_an_error(config, reason):
    problem = adapter_support_problem(config, ALL)
    assert problem is not None and reason in problem, problem


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda m: m.update(total_bytes=m["total_bytes"] + 1), "bad_manifest"),  # not what its files add up to
        (lambda m: m.update(tensor_count=m["tensor_count"] + 2), "bad_manifest"),
        (lambda m: m["files"]["adapter_model.safetensors"].update(tensors=1), "bad_manifest"),
        (lambda m: m.update(dtype="F16"), "dtype_mismatch"),
    ],
)
def test_manifest_fields_that_disagree_with_the_files_are_refused(tmp_path, edit, reason):
    path = publish(tmp_path).path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["dtype"] == "F32"
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert rejected(tmp_path).reason == reason


def test_digests_are_checked_without_a_stage_when_asked(tmp_path):
    path = publish(tmp_path).path
    weights = path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size, header intact: only the digest can tell
    weights.write_bytes(bytes(data))
    assert validate_adapter(path, root=tmp_path, reference=REFERENCE, limits=LIMITS).path == path
    with pytest.raises(CheckpointError) as info:
        validate_adapter(path, root=tmp_path, reference=REFERENCE, limits=LIMITS, check_digests=True)
    assert info.value.reason == "digest_mismatch"


def test_an_adapter_header_declaring_more_tensors_than_the_manifest_is_refused_before_it_is_parsed(
    tmp_path, monkeypatch
):
    """A junk adapter file whose header lists thousands of tiny tensors (up to its 16 MiB cap:
    ~100 MB as parsed objects): counted against the manifest first, never parsed (session 26)."""
    import struct

    import rollout_service.checkpoint_reader as reader
    from rollout_service.digest import format_digest, new_hasher

    path = publish(tmp_path).path
    junk = {f"junk.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(5000)}
    raw = json.dumps(junk, separators=(",", ":")).encode()
    data = struct.pack("<Q", len(raw)) + raw
    (path / "adapter_model.safetensors").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    h = new_hasher()
    h.update(data)
    manifest["files"]["adapter_model.safetensors"].update(size=len(data), digest=format_digest(h))
    manifest["total_bytes"] = sum(f["size"] for f in manifest["files"].values())
    (path / "manifest.json").write_text(json.dumps(manifest))
    opened = []
    real_open = reader.safe_open
    monkeypatch.setattr(reader, "safe_open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    err = rejected(tmp_path)
    assert err.reason == "bad_manifest" and "or more tensors" in str(err), err
    assert opened == []  # safetensors never parsed the junk header
