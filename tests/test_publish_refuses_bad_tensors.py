"""Weights that every reader would reject are refused by the writers, and nothing of the step
becomes visible: NaN/Inf in a floating tensor (``publish_checkpoint`` and the delta writer), a
tensor named ``__metadata__`` (it replaces the safetensors metadata entry), a name with a lone
surrogate (invalid header JSON). A delta writer that refused a version still publishes the next
one as a delta that rebuilds bit for bit (its held copy is the last published version again)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model, assert_same_files
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints, validate_checkpoint
from rollout_service.checkpoint_writer import PublishRefused, PublishResult, publish_checkpoint
from rollout_service.delta_apply import materialize
from rollout_service.delta_writer import DeltaCheckpointWriter

BAD_VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def state(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(32, 16, generator=g).to(dtype)),
        ("model.layers.0.mlp.weight", torch.randn(64, 16, generator=g).to(dtype)),
        ("model.norm.weight", torch.randn(16, generator=g).to(dtype)),
    ]


def assert_nothing_new(root: Path, before: list[str]) -> None:
    """The root holds what it held before: no step folder, no work folder left behind."""
    assert (sorted(p.name for p in root.iterdir()) if root.exists() else []) == before


def streamed(tensors: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from tensors  # a generator: names are checked as they stream in, not up front


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("bad", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("shards", ["one", "several"])
def test_non_finite_weights_are_refused_and_nothing_is_published(
    tmp_path: Path, dtype: str, bad: str, shards: str
) -> None:
    root = tmp_path / "root"
    good = publish_checkpoint(root, 1, state(DTYPES[dtype]), config=CONFIG, run_id=RUN)
    before = sorted(p.name for p in root.iterdir())
    tensors = state(DTYPES[dtype], seed=1)
    tensors[1][1][5, 3] = BAD_VALUES[bad]
    tensors[1][1][60, 0] = BAD_VALUES[bad]
    with pytest.raises(PublishRefused) as info:
        publish_checkpoint(
            root,
            2,
            streamed(tensors),
            config=CONFIG,
            run_id=RUN,
            max_shard_bytes=2048 if shards == "several" else 1 << 30,
        )
    err = info.value
    assert isinstance(err, ValueError)
    assert err.rule == "non_finite" and err.tensor == "model.layers.0.mlp.weight" and err.count == 2
    text = str(err)
    assert "'model.layers.0.mlp.weight' holds 2 NaN/Inf" in text and "not published" in text
    assert "learning rate" in text
    assert_nothing_new(root, before)
    assert [c.path for c in list_checkpoints(root)] == [good.path]
    validate_checkpoint(good.path, check_digests=True, check_finite=True)


def test_an_overflow_in_the_cast_is_refused_as_written(tmp_path: Path) -> None:
    """1e6 is finite in float32 and +Inf in float16: what counts is the bytes as written."""
    root = tmp_path / "root"
    tensors = state()
    tensors[0][1][0, 0] = 1e6
    with pytest.raises(PublishRefused, match=r"'model.embed_tokens.weight' holds 1 NaN/Inf .*\(F16\)"):
        publish_checkpoint(root, 1, tensors, config=CONFIG, dtype="float16", run_id=RUN)
    assert_nothing_new(root, [])
    publish_checkpoint(root, 1, tensors, config=CONFIG, dtype="bfloat16", run_id=RUN)  # fits bf16


def test_check_finite_false_still_writes_what_readers_reject(tmp_path: Path) -> None:
    """For tests of the readers: the old behaviour on request."""
    tensors = state()
    tensors[2][1][0] = float("nan")
    result = publish_checkpoint(tmp_path, 1, tensors, config=CONFIG, run_id=RUN, check_finite=False)
    with pytest.raises(ValueError) as info:
        validate_checkpoint(result.path, check_finite=True)
    assert getattr(info.value, "reason", None) == "non_finite"


BAD_NAMES = {
    "__metadata__": ("__metadata__", "reserved for the safetensors metadata entry"),
    "lone surrogate": ("a\udcffb", "lone surrogate"),
    "surrogate pair as two code points": ("x\ud83d\ude00", "lone surrogate"),
    "empty": ("", "non-empty strings"),
    "not a string": (7, "non-empty strings"),
}


@pytest.mark.parametrize("how", ["list", "generator"])
@pytest.mark.parametrize("case", list(BAD_NAMES), ids=list(BAD_NAMES))
def test_names_readers_reject_are_refused_with_the_tensor_and_the_rule(tmp_path: Path, case: str, how: str) -> None:
    root = tmp_path / "root"
    name, rule = BAD_NAMES[case]
    tensors = state()
    tensors.insert(2, (name, torch.ones(4)))  # type: ignore[arg-type]
    with pytest.raises(PublishRefused, match=rule) as info:
        publish_checkpoint(root, 1, tensors if how == "list" else streamed(tensors), config=CONFIG, run_id=RUN)
    assert info.value.rule == "tensor_name" and isinstance(info.value, ValueError)
    if isinstance(name, str) and name:
        assert repr(name) in str(info.value)
    assert_nothing_new(root, [])


def test_a_list_with_a_bad_name_is_refused_before_the_work_folder_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollout_service.checkpoint_writer as cw

    made: list[int] = []
    real = cw.atomic_step_dir

    def watched(root: Path | str, step: int) -> Any:
        made.append(step)
        return real(root, step)

    monkeypatch.setattr(cw, "atomic_step_dir", watched)
    tensors = [*state(), ("__metadata__", torch.ones(2))]
    with pytest.raises(PublishRefused):
        publish_checkpoint(tmp_path / "root", 1, tensors, config=CONFIG, run_id=RUN)
    tensors = [*state(), state()[0]]
    with pytest.raises(PublishRefused, match="appears twice") as info:
        publish_checkpoint(tmp_path / "root", 1, tensors, config=CONFIG, run_id=RUN)
    assert info.value.rule == "duplicate"
    assert made == []


def test_odd_names_readers_accept_are_still_published(tmp_path: Path) -> None:
    tensors = [("a\x00b", torch.ones(2)), ("é/../x", torch.ones(3)), ("__meta__", torch.ones(1)), ("😀", torch.ones(1))]
    result = publish_checkpoint(tmp_path, 1, tensors, config=CONFIG, run_id=RUN)
    validate_checkpoint(result.path, check_digests=True, check_finite=True)


# --- the delta writer ------------------------------------------------------------------------


def _publish_reference(root: Path, step: int, model: Model) -> Path:
    return publish_checkpoint(
        root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN
    ).path


def _spoil(model: Model, how: str) -> list[tuple[str, torch.Tensor]]:
    tensors = [(k, v.detach().clone()) for k, v in model.tensors()]
    if how in BAD_VALUES:
        tensors[3][1][7, 2] = BAD_VALUES[how]  # layer1.q, after two tensors changed in place
    elif how == "__metadata__":
        tensors.insert(4, ("__metadata__", torch.ones(3)))
    else:
        tensors.insert(4, ("bad\udcff", torch.ones(3)))
    return tensors


@pytest.mark.parametrize("how", [*BAD_VALUES, "__metadata__", "surrogate"])
def test_the_delta_writer_refuses_and_its_next_delta_rebuilds_bit_for_bit(tmp_path: Path, how: str) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-4)
    writer = DeltaCheckpointWriter(full_every=100, threads=2)

    def publish(step: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishResult:
        return writer.publish(root, step, tensors, config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)

    assert publish(1, model.tensors()).kind == "full"
    _publish_reference(full_root, 1, model)
    model.step()
    assert publish(2, model.tensors()).kind == "delta"
    _publish_reference(full_root, 2, model)
    held_before = {k: h.data.copy() for k, h in writer._held.items()}
    before = sorted(p.name for p in root.iterdir())

    model.step()
    with pytest.raises(PublishRefused) as info:
        publish(3, _spoil(model, how))
    if how in BAD_VALUES:
        assert info.value.rule == "non_finite" and info.value.tensor == "layer1.q" and info.value.count == 1
    else:
        assert info.value.rule == "tensor_name"
    assert_nothing_new(root, before)
    # the held copy is the last published version again, byte for byte
    assert {k: h.data.tobytes() for k, h in writer._held.items()} == {k: v.tobytes() for k, v in held_before.items()}

    result = publish(3, model.tensors())
    assert result.kind == "delta", writer.last.why_full
    delta = Manifest.load(result.path).delta
    assert delta is not None and delta.base_step == 2
    reference = _publish_reference(full_root, 3, model)
    out = tmp_path / "rebuilt"
    rebuilt = materialize(root, 3, out)
    assert rebuilt.kind == "full"
    assert_same_files(out, reference)
    validate_checkpoint(out, check_digests=True, check_finite=True)


def test_a_refused_full_version_makes_the_next_publish_full_and_correct(tmp_path: Path) -> None:
    """The first version (full: nothing held) with a NaN: refused in absorb, nothing written;
    the next version is full and matches a plain publish."""
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-4)
    writer = DeltaCheckpointWriter(full_every=100, threads=2)
    with pytest.raises(PublishRefused, match="layer1.q"):
        writer.publish(root, 1, _spoil(model, "nan"), config=CONFIG, dtype="bfloat16", run_id=RUN)
    assert not root.exists() or list(root.iterdir()) == []
    result = writer.publish(
        root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN
    )
    assert result.kind == "full"
    assert_same_files(result.path, _publish_reference(full_root, 1, model))
    model.step()
    assert (
        writer.publish(
            root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN
        ).kind
        == "delta"
    )
    out = tmp_path / "rebuilt"
    materialize(root, 2, out)
    assert_same_files(out, _publish_reference(full_root, 2, model))
    assert step_dir_name(2) in {p.name for p in root.iterdir()}


def test_a_manifest_readers_would_refuse_is_never_published(tmp_path: Path) -> None:
    """A base_model longer than readers take (a manifest field, not a tensor): refused by the
    writers with the reader's reason, nothing published, for full and delta publishes alike."""
    root = tmp_path / "root"
    publish_checkpoint(root, 1, state(), config=CONFIG, run_id=RUN)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(PublishRefused, match="base_model") as info:
        publish_checkpoint(root, 2, state(seed=1), config=CONFIG, run_id=RUN, base_model="m" * 5000)
    assert info.value.rule == "bad_manifest"
    assert_nothing_new(root, before)
    writer = DeltaCheckpointWriter()
    writer.publish(root, 2, state(torch.bfloat16), config=CONFIG, run_id=RUN)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(PublishRefused, match="base_model"):
        writer.publish(root, 3, state(torch.bfloat16, seed=1), config=CONFIG, run_id=RUN, base_model="m" * 5000)
    assert_nothing_new(root, before)
    assert publish_checkpoint(root, 3, state(), config=CONFIG, run_id=RUN, base_model="m" * 4096).step == 3
