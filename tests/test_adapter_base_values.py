"""An adapter step records which base model it was trained on (``adapter.base_values``: digests
of a few base tensors' values, rounded to bfloat16), so that an adapter trained on another model
of the same shapes is refused (``adapter_base_mismatch``) instead of loading silently. Here: the
digests agree across the dtypes a trainer and a model folder hold the same weights in, the
trainer's record matches its base model's folder and not another one's (through ``validate``),
and the manifest field is untrusted input. The sidecar's refusal, with real SGLang, is in
``test_lora_sync.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout_service.adapter_writer import publish_adapter
from rollout_service.base_values import SAMPLE_ELEMENTS, digests_in_model_dir, pick_base_tensors, values_digest
from rollout_service.checkpoint_format import MANIFEST_NAME, CheckpointError, Manifest
from rollout_service.tiny_model import make_tiny_model

CLI = [sys.executable, "-m", "rollout_service.cli"]


def test_the_digest_agrees_across_the_dtypes_of_the_same_weights(tmp_path: Path) -> None:
    w = torch.randn(300, 500)
    w.view(-1)[:50] *= 1e-7  # values float16 cannot hold: a float16 trainer has lost them
    save_file({"bf16": w.to(torch.bfloat16), "f32": w, "f16": w.to(torch.float16)}, str(tmp_path / "model.safetensors"))
    names = ["bf16", "f32", "f16", "absent"]
    as_f32 = digests_in_model_dir(tmp_path, dict.fromkeys(names, "F32"))
    rounded = values_digest(w.to(torch.bfloat16).float().numpy(), "F32")  # a trainer's fp32 copy of bf16 files
    assert as_f32["bf16"] == as_f32["f32"] == rounded and as_f32["absent"] is None
    assert values_digest((w * 1.01).numpy(), "F32") != rounded
    assert values_digest(torch.cat([w.reshape(-1)[:SAMPLE_ELEMENTS], torch.zeros(5)]).numpy(), "F32") == rounded
    # A float16 trainer (GPUs without bfloat16) holds what float16 keeps of the files' values.
    as_f16 = digests_in_model_dir(tmp_path, dict.fromkeys(names, "F16"))
    for source in (torch.bfloat16, torch.float32):
        trainer = w.to(source).to(torch.float16)
        assert as_f16[{torch.bfloat16: "bf16", torch.float32: "f32"}[source]] == values_digest(
            trainer.float().numpy(), "F16"
        )
    assert as_f16["bf16"] != as_f32["bf16"]  # the small values: the dtype matters
    assert as_f16["f16"] == values_digest(w.to(torch.float16).float().numpy(), "F16")


def test_the_picked_tensors_are_adapted_weights_and_norms() -> None:
    shapes = {"a.q.weight": (4, 4), "b.q.weight": (4, 4), "c.mlp.weight": (8, 4), "a.norm": (4,), "z.norm": (4,)}
    assert pick_base_tensors(shapes, {"a.q.weight", "b.q.weight", "missing"}) == [
        "a.q.weight",
        "b.q.weight",
        "a.norm",
        "z.norm",
    ]
    assert pick_base_tensors({"only": (4,)}, set()) == ["only"]


def _publish_from(base_dir: Path, root: Path, step: int, dtype: torch.dtype = torch.float32) -> Path:
    """An adapter published as the trainer does, from a PEFT model on ``base_dir``."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from trainer_hooks.adapter_publish import base_values_of

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    values = base_values_of(model)
    assert len(values) == 4 and any("q_proj" in n for n in values) and any("norm" in n for n in values), values
    result = publish_adapter(
        root,
        step,
        get_peft_model_state_dict(model),
        model.peft_config["default"].to_dict(),
        run_id="r",
        base_values=values,
    )
    return result.path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_validate_tells_the_base_an_adapter_was_trained_on(tiny_model_dir: Path, tmp_path: Path, dtype) -> None:
    """Whatever dtype the trainer loaded the base model in (float16 on GPUs without bfloat16)."""
    step = _publish_from(tiny_model_dir, tmp_path / "root", 1, dtype)
    same = subprocess.run(
        [*CLI, "validate", str(step), "--reference", str(tiny_model_dir)], capture_output=True, text=True
    )
    assert same.returncode == 0, same.stderr
    assert any("trained on this base model (4 tensors" in c for c in json.loads(same.stdout)["checks"]), same.stdout
    other = make_tiny_model(tmp_path / "other", seed=1)  # the same shapes, other values
    wrong = subprocess.run([*CLI, "validate", str(step), "--reference", str(other)], capture_output=True, text=True)
    assert wrong.returncode == 1 and wrong.stderr.startswith("INVALID (adapter_base_mismatch): "), wrong.stderr
    assert "trained on another base model" in wrong.stderr


@pytest.mark.parametrize(
    "base_values",
    [
        {},
        {f"t{i}": {"dtype": "F32", "digest": "xxh3_128:" + "0" * 32} for i in range(9)},
        {"t": {"dtype": "F32", "digest": "md5:0"}},
        {"t": {"dtype": "I8", "digest": "xxh3_128:" + "0" * 32}},
        {"t": {"dtype": "F32", "digest": "xxh3_128:" + "0" * 32, "more": 1}},
        {"t": "xxh3_128:" + "0" * 32},
        {"": {"dtype": "F32", "digest": "xxh3_128:" + "0" * 32}},
        ["t"],
    ],
    ids=["empty", "too-many", "bad-digest", "bad-dtype", "extra-key", "not-an-object", "empty-name", "not-a-mapping"],
)
def test_base_values_in_a_manifest_are_untrusted(tiny_model_dir: Path, tmp_path: Path, base_values) -> None:
    step = _publish_from(tiny_model_dir, tmp_path / "root", 1)
    data = json.loads((step / MANIFEST_NAME).read_text())
    data["adapter"]["base_values"] = base_values
    with pytest.raises(CheckpointError) as err:
        Manifest.from_json(json.dumps(data))
    assert err.value.reason == "bad_manifest" and "adapter.base_values" in str(err.value)


def test_an_adapter_without_base_values_reads_as_before(tiny_model_dir: Path, tmp_path: Path) -> None:
    step = _publish_from(tiny_model_dir, tmp_path / "root", 1)
    data = json.loads((step / MANIFEST_NAME).read_text())
    del data["adapter"]["base_values"]
    manifest = Manifest.from_json(json.dumps(data))
    assert manifest.adapter is not None and manifest.adapter.base_values is None
    assert "base_values" not in json.loads(manifest.to_json())["adapter"]


def test_a_published_step_as_reference_is_read_only_by_its_manifests_shards(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``validate ADAPTER --reference STEP``: a published step's folder is untrusted, so the base
    check reads only the shards its manifest lists, inside it. An index nobody vouches for, naming
    a link to another model's weights outside the root, decided the verdict before."""
    from safetensors.torch import load_file

    from rollout_service.checkpoint_writer import publish_checkpoint

    root = tmp_path / "root"
    step = _publish_from(tiny_model_dir, root, 2)
    weights = sorted(load_file(str(tiny_model_dir / "model.safetensors")).items())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    full = publish_checkpoint(root, 1, weights, config=config, run_id="r").path
    ok = subprocess.run([*CLI, "validate", str(step), "--reference", str(full)], capture_output=True, text=True)
    assert ok.returncode == 0 and "trained on this base model (4 tensors" in ok.stdout, ok.stderr
    other = make_tiny_model(tmp_path / "other", seed=1)  # the same shapes, other values
    (full / "other.safetensors").symlink_to(other / "model.safetensors")
    weight_map = {
        n: "other.safetensors" for n in json.loads((step / MANIFEST_NAME).read_text())["adapter"]["base_values"]
    }
    (full / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    still = subprocess.run([*CLI, "validate", str(step), "--reference", str(full)], capture_output=True, text=True)
    assert still.returncode == 0 and "trained on this base model (4 tensors" in still.stdout, still.stderr


def test_a_model_folder_whose_index_cannot_be_read_is_an_error_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The operator's reference folder at fault is a usage error (exit 2) naming the file, not a
    traceback or a verdict on the adapter step."""
    import shutil

    step = _publish_from(tiny_model_dir, tmp_path / "root", 1)
    folder = tmp_path / "base"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors.index.json").write_text("{" * 200_000)
    out = subprocess.run([*CLI, "validate", str(step), "--reference", str(folder)], capture_output=True, text=True)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "cannot read --reference" in out.stderr and "model.safetensors.index.json" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
