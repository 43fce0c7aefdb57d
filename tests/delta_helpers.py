"""Publishing chains of delta checkpoints of the tiny model for tests (no SGLang here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rollout_service.delta_writer import DeltaCheckpointWriter
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
