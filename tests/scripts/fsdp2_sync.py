"""Checkpoint sync from a model sharded with FSDP2 across CPU processes (gloo).

    torchrun --standalone --nproc_per_node 2 tests/scripts/fsdp2_sync.py --sglang-url U \
        --sidecar-url S --checkpoint-path C --out result.json [--steps 2]

accelerate maps FSDP onto GPU-like devices only (on CPU it runs MULTI_CPU, plain DDP), so a TRL
run cannot be sharded with FSDP here. This script shards the tiny model the way accelerate's
FSDP2 plugin does (``fully_shard`` on each decoder layer, then on the root), trains a few plain
language-model steps so the weights move, and calls :class:`SGLangGeneration`'s
``sync_weights`` and ``generate`` on every process, exactly as GRPOTrainer does: the weight
gathering is the real ``DTensor.full_tensor()`` all-gather of every parameter.

The main process writes: whether parameters were sharded, whether each published checkpoint
equals the full (unsharded) trained weights, and the weight versions SGLang answered with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_service.checkpoint_reader import latest_checkpoint
from rollout_service.tiny_model import ensure_tiny_model
from script_args import rollout_unit_parser
from trainer_hooks import GRPOConfig, build_sglang_generation


def main() -> None:
    p = rollout_unit_parser(steps=2)
    a = p.parse_args()
    # The config first: building TrainingArguments resets accelerate's shared state.
    args = GRPOConfig(
        output_dir=str(Path(a.out).parent / "fsdp2-trainer"),
        checkpoint_path=a.checkpoint_path,
        sglang_urls=[a.sglang_url],
        sidecar_urls=[a.sidecar_url],
        use_cpu=True,
        bf16=False,
        report_to=[],
        sync_timeout=300.0,
        keep_checkpoints=None,
        checkpoint_max_shard_mb=1.0,
    )  # several shards: the writer holds tensors across gathers
    accelerator = Accelerator(cpu=True)
    world = accelerator.num_processes
    model_dir = ensure_tiny_model(tied=False)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    big = [p for p in model.parameters() if p.shape[0] >= world]
    sharded = bool(big) and all(type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel() for p in big)

    step = 0
    generation = build_sglang_generation(
        model, accelerator, tok, args=args, max_completion_length=6, current_step=lambda: step
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(accelerator.process_index)
    checks = []
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (4, 12))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        generation.sync_weights()
        prompts = [tok.encode(f"word {accelerator.process_index} {step}")] * 2
        _, completions, _, _ = generation.generate(prompts, None, num_generations=2)
        # The full weights, gathered collectively on every process, as a user would save them.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if accelerator.is_main_process:
            ckpt = latest_checkpoint(a.checkpoint_path)
            published: dict[str, torch.Tensor] = {}
            for shard in sorted(ckpt.path.glob("*.safetensors")):
                published.update(load_file(str(shard)))
            diffs = {k: (published[k] - full[k]).abs().max().item() for k in published if k in full}
            record = generation.history[-1]
            checks.append(
                {
                    "step": ckpt.step,
                    "shards": len(list(ckpt.path.glob("*.safetensors"))),
                    "published_equals_trained": set(published) == set(full) and max(diffs.values()) == 0.0,
                    "missing": sorted(set(full) - set(published)),
                    "extra": sorted(set(published) - set(full)),
                    "max_abs_diff": max(diffs.values()),
                    "served_versions": sorted({v for v in record.versions}),
                    "completions": len(completions),
                }
            )
        dist.barrier()
    generation.close()
    if accelerator.is_main_process:
        Path(a.out).write_text(json.dumps({"processes": world, "sharded": sharded, "checks": checks}, indent=2))


if __name__ == "__main__":
    main()
