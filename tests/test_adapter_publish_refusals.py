"""The adapter publisher refuses what every reader would reject, as the full and delta publishers
do (``test_publish_refuses_bad_tensors.py``), and nothing of the step becomes visible: NaN/Inf in
a LoRA weight (as written, after the cast), a tensor name readers cannot parse (``__metadata__``,
a lone surrogate, not a string), a tensor that is not floating point (LoRA weights are), a header
larger than readers accept, a dtype adapters are not published in. ``check_finite=False`` still
writes a NaN adapter, for tests of the readers. The trainer's ``AdapterPublisher`` refuses a
diverged adapter the same way and publishes the next good one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import rollout_service.adapter_writer as aw
from rollout_service.adapter_reader import AdapterReport, LoraLimits, validate_adapter
from rollout_service.adapter_writer import publish_adapter
from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import TensorSpecs, list_checkpoints
from rollout_service.checkpoint_writer import PublishRefused, PublishResult
from trainer_helpers import RecordingWaiter

RUN = "run1"
HIDDEN, KV = 16, 8
REFERENCE: TensorSpecs = {
    "model.layers.0.self_attn.q_proj.weight": ("F32", (HIDDEN, HIDDEN)),
    "model.layers.0.self_attn.v_proj.weight": ("F32", (KV, HIDDEN)),
}
LIMITS = LoraLimits(enabled=True, max_rank=16, target_modules=frozenset({"q_proj", "v_proj"}))
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
V_A = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
V_B = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
BAD_VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config(r: int = 4) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": {"q_proj", "v_proj"},
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
    }


def tensors(dtype: torch.dtype = torch.float32, seed: int = 0, r: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        Q_A: torch.randn(r, HIDDEN, generator=g).to(dtype),
        Q_B: torch.randn(HIDDEN, r, generator=g).to(dtype),
        V_A: torch.randn(r, HIDDEN, generator=g).to(dtype),
        V_B: torch.randn(KV, r, generator=g).to(dtype),
    }


def publish(root: Path, step: int, state: dict[Any, torch.Tensor], **kw: Any) -> PublishResult:
    return publish_adapter(root, step, state, config(), run_id=RUN, **kw)


def validate(root: Path, step: int) -> AdapterReport:
    return validate_adapter(
        root / step_dir_name(step), root=root, reference=REFERENCE, limits=LIMITS, check_finite=True, check_digests=True
    )


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture
def no_work_folder(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Steps for which the adapter publisher made a work folder (refusals come before it)."""
    made: list[int] = []
    real = aw.atomic_step_dir

    def watched(root: Path | str, step: int) -> Any:
        made.append(step)
        return real(root, step)

    monkeypatch.setattr(aw, "atomic_step_dir", watched)
    return made


# --- NaN / Inf -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("bad", list(BAD_VALUES), ids=list(BAD_VALUES))
def test_non_finite_adapter_weights_are_refused_and_nothing_is_published(
    tmp_path: Path, dtype: str, bad: str, no_work_folder: list[int]
) -> None:
    root = tmp_path / "root"
    good = publish(root, 1, tensors(DTYPES[dtype]))
    before = listing(root)
    state = tensors(DTYPES[dtype], seed=1)
    state[V_B][3, 1] = BAD_VALUES[bad]
    state[V_B][7, 0] = BAD_VALUES[bad]
    with pytest.raises(PublishRefused) as info:
        publish(root, 2, state)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.rule == "non_finite" and err.tensor == V_B and err.count == 2
    text = str(err)
    assert f"{V_B!r} holds 2 NaN/Inf value(s) among its {KV * 4}" in text and "not published" in text
    assert "learning rate" in text
    assert listing(root) == before  # no step folder, no work folder left behind
    assert no_work_folder == [1]  # refused before the work folder of step 2 was made
    assert [c.path for c in list_checkpoints(root)] == [good.path]
    validate(root, 1)


def test_an_overflow_in_the_cast_is_refused_as_written(tmp_path: Path) -> None:
    """1e6 is finite in float32 and +Inf in float16: what counts is the bytes as written."""
    root = tmp_path / "root"
    state = tensors()
    state[Q_A][0, 0] = 1e6
    with pytest.raises(PublishRefused, match=rf"{Q_A!r} holds 1 NaN/Inf .*\(F16\)") as info:
        publish(root, 1, state, dtype="float16")
    assert info.value.rule == "non_finite"
    assert listing(root) == []
    result = publish(root, 1, state, dtype="bfloat16")  # fits bf16
    assert Manifest.load(result.path).dtype == "BF16"
    validate(root, 1)


def test_check_finite_false_still_writes_an_adapter_readers_reject(tmp_path: Path) -> None:
    """For tests of the readers: the old behaviour on request."""
    state = tensors()
    state[Q_B][0, 0] = float("nan")
    publish(tmp_path, 1, state, check_finite=False)
    with pytest.raises(CheckpointError) as info:
        validate(tmp_path, 1)
    assert info.value.reason == "non_finite"


# --- names -----------------------------------------------------------------------------------

BAD_NAMES = {
    "__metadata__": ("__metadata__", "reserved for the safetensors metadata entry"),
    "lone surrogate": ("base_model.model.a\udcffb.q_proj.lora_A.weight", "lone surrogate"),
    "surrogate pair as two code points": ("x\ud83d\ude00.lora_B.weight", "lone surrogate"),
    "empty": ("", "non-empty strings"),
    "not a string": (7, "non-empty strings"),
}


@pytest.mark.parametrize("case", list(BAD_NAMES), ids=list(BAD_NAMES))
def test_names_readers_reject_are_refused_before_anything_is_made(
    tmp_path: Path, case: str, no_work_folder: list[int]
) -> None:
    root = tmp_path / "root"
    name, says = BAD_NAMES[case]
    state: dict[Any, torch.Tensor] = dict(tensors())
    state[name] = torch.ones(4, HIDDEN)
    with pytest.raises(PublishRefused, match=says) as info:
        publish(root, 1, state)
    assert info.value.rule == "tensor_name" and isinstance(info.value, ValueError)
    if isinstance(name, str) and name:
        assert repr(name) in str(info.value)
    assert listing(root) == [] and no_work_folder == []


def test_a_header_larger_than_readers_accept_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers refuse an adapter header past MAX_ADAPTER_HEADER_BYTES (far below the 100 MB of a
    model shard's): so does the writer, or every replica would reject what it published."""
    monkeypatch.setattr(aw, "MAX_ADAPTER_HEADER_BYTES", 4096)  # real cap: 16 MiB of names
    root = tmp_path / "root"
    state = tensors()
    for i in range(12):  # each name fits alone, together they do not
        state[f"base_model.model.model.layers.0.self_attn.q_proj{'x' * 300}{i}.lora_A.weight"] = torch.ones(4, HIDDEN)
    with pytest.raises(PublishRefused, match="over the 4096 readers accept") as info:
        publish(root, 1, state)
    assert info.value.rule == "header_too_large"
    assert listing(root) == []


# --- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool], ids=str)
def test_a_lora_weight_that_is_not_floating_point_is_refused(
    tmp_path: Path, dtype: torch.dtype, no_work_folder: list[int]
) -> None:
    root = tmp_path / "root"
    state = tensors()
    state[Q_B] = state[Q_B].to(dtype)
    with pytest.raises(PublishRefused, match="float32, float16 or bfloat16") as info:
        publish(root, 1, state, dtype="bfloat16")  # a cast applies to floating tensors only
    assert info.value.rule == "dtype" and info.value.tensor == Q_B and isinstance(info.value, ValueError)
    assert repr(Q_B) in str(info.value) and "Nothing was published" in str(info.value)
    assert listing(root) == [] and no_work_folder == []


def test_float64_weights_are_refused_unless_cast_and_float64_is_no_adapter_dtype(
    tmp_path: Path, no_work_folder: list[int]
) -> None:
    root = tmp_path / "root"
    state = tensors(torch.float64)
    with pytest.raises(PublishRefused, match="dtype=") as info:
        publish(root, 1, state)
    assert info.value.rule == "dtype"
    for dtype in ("float64", "F8_E4M3"):  # a manifest dtype the written tensors would not have
        with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
            publish(root, 1, tensors(), dtype=dtype)
    assert listing(root) == [] and no_work_folder == []
    assert Manifest.load(publish(root, 1, state, dtype="float32").path).dtype == "F32"
    validate(root, 1)


# --- the trainer's AdapterPublisher ----------------------------------------------------------


def test_the_trainer_refuses_a_diverged_adapter_and_publishes_the_next_good_one(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer_hooks.adapter_publish import AdapterPublisher
    from trainer_hooks.checkpoint_publisher import CheckpointPublisher

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    root = tmp_path / "ckpts"
    waiter = RecordingWaiter()
    publisher = CheckpointPublisher(
        root,
        waiter,  # type: ignore[arg-type]
        config={},
        dtype=None,
        max_shard_bytes=1 << 20,
        keep=None,
        sync_timeout_s=10,
        heartbeat_max_age_s=10,
    )
    adapters = AdapterPublisher(publisher, model, "bfloat16")
    weight = next(p for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        weight[0, 0] = float("inf")
    with pytest.raises(PublishRefused) as info:
        adapters.publish_and_wait()
    assert info.value.rule == "non_finite" and "lora_B" in info.value.tensor
    assert listing(root) == [] and list_checkpoints(root) == []
    assert waiter.calls == [] and publisher.confirmed_version is None and adapters.current() is None
    with torch.no_grad():
        weight[0, 0] = 0.0
    record = adapters.publish_and_wait()
    assert record.kind == "adapter" and adapters.current() is not None
    assert [c.step for c in list_checkpoints(root)] == [record.version]
    assert waiter.calls == [("notify", record.version), ("wait", record.version)]
