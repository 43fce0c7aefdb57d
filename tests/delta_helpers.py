"""Publishing chains of delta checkpoints of the tiny model for tests (no SGLang here)."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import torch

from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar.staging import Stage
from rollout_service.untrusted_files import Deadline
from sidecar_helpers import perturbed_state


def evolving_state(model_dir: Path, step: int) -> dict:
    """The model's weights with every 50th element moved by 0.05 per step: consecutive versions
    differ in ~4% of their elements, as at RL learning rates."""
    state = perturbed_state(model_dir, 0, scale=0.0)
    out = {}
    for k, v in state.items():
        v = v.clone()
        v.view(-1)[step % 50 :: 50] += 0.05 * step
        out[k] = v
    return out


def publish_chain(
    root: Path,
    model_dir: Path,
    steps: range,
    full_every: int = 100,
    writer: DeltaCheckpointWriter | None = None,
    run_id: str = "r",
) -> tuple[DeltaCheckpointWriter, dict[int, dict]]:
    """Publish ``steps`` of :func:`evolving_state` through one delta writer (bf16)."""
    writer = writer or DeltaCheckpointWriter(full_every=full_every)
    config = json.loads((model_dir / "config.json").read_text())
    states = {}
    for step in steps:
        states[step] = evolving_state(model_dir, step)
        writer.publish(root, step, sorted(states[step].items()), config=config, dtype="bfloat16", run_id=run_id)
    return writer, states


def as_published(state: dict) -> dict:
    """What SGLang gets of ``state``: bf16-rounded (as float32)."""
    return {k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items()}


CONFIG = {"model_type": "qwen2", "hidden_size": 64}
RUN = "run1"


class Model:
    """fp32 master weights stepped by AdamW with random gradients (Adam's step does not depend
    on the gradient's scale, so the update sizes are realistic); published in bf16."""

    def __init__(self, lr: float = 1e-5, seed: int = 0, shapes: dict[str, tuple[int, ...]] | None = None):
        g = torch.Generator().manual_seed(seed)
        shapes = shapes or {
            "embed": (512, 64),
            "layer0.q": (64, 64),
            "layer0.mlp": (256, 64),
            "layer1.q": (64, 64),
            "layer1.mlp": (256, 64),
            "norm": (64,),
        }
        self.params = {k: torch.nn.Parameter(torch.randn(*s, generator=g) * 0.05) for k, s in shapes.items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr)
        self.g = g

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.g)
        self.opt.step()

    def tensors(self):
        return list(self.params.items())


def publish_both(
    writer: DeltaCheckpointWriter, root: Path, full_root: Path, step: int, model: Model, max_shard_bytes: int = 40_000
):
    result = writer.publish(
        root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=max_shard_bytes, run_id=RUN
    )
    reference = publish_checkpoint(
        full_root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=max_shard_bytes, run_id=RUN
    )
    return result, reference


def assert_same_files(rebuilt: Path, full: Path) -> None:
    ref = Manifest.load(full)
    names = sorted(ref.files)
    assert sorted(p.name for p in rebuilt.iterdir() if p.name != "manifest.json") == names
    for name in names:
        assert filecmp.cmp(rebuilt / name, full / name, shallow=False), name


def stage_through(stage: Stage, root: Path, step: int):
    """Build steps 1 .. ``step`` under ``root`` into ``stage`` one after another, each pruned to
    the newest as the sidecar does; returns the last build (None for step 0)."""
    built = None
    for s in range(1, step + 1):
        path = root / step_dir_name(s)
        built = stage.build(root, path, Manifest.load(path), Deadline(60))
        stage.prune({built.path})
    return built
