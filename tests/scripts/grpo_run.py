"""A small GRPO run with trainer_hooks, for tests that need `accelerate launch` or PEFT.

    torchrun --standalone --nproc_per_node 2 tests/scripts/grpo_run.py --sglang-url U \
        --sidecar-url S --checkpoint-path C --out result.json [--steps 3] [--peft | --zero3]

``--zero3`` trains under DeepSpeed ZeRO stage 3 on the CPU (accelerate's DeepSpeed plugin,
gloo, every parameter partitioned), so each sync gathers parameters one by one.

Writes (main process) the log history, the final checkpoint version, and whether the last
published checkpoint equals the trained (merged, for PEFT) weights.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_demo.demo import make_prompts, word_start_reward
from rollout_service.checkpoint_reader import latest_checkpoint
from rollout_service.tiny_model import ensure_tiny_model
from script_args import rollout_unit_parser
from trainer_hooks import GRPOConfig, GRPOTrainer


def main() -> None:
    p = rollout_unit_parser(steps=3)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--peft", action="store_true")
    mode.add_argument("--zero3", action="store_true", help="DeepSpeed ZeRO-3 on CPU")
    a = p.parse_args()
    if a.zero3:
        _use_zero3_on_cpu(Path(a.out).parent)
    model_dir = ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_config = None
    if a.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    args = GRPOConfig(
        output_dir=str(Path(a.out).parent / "trainer"),
        checkpoint_path=a.checkpoint_path,
        sglang_urls=[a.sglang_url],
        sidecar_urls=[a.sidecar_url],
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=8,
        max_steps=a.steps,
        learning_rate=5e-2 if a.peft else 1e-2,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        disable_tqdm=True,
        sync_timeout=300.0,
        keep_checkpoints=None,
        seed=0,
        # DeepSpeed: accelerate drops its plugin under use_cpu, and needs gloo named.
        **(dict(use_cpu=False, ddp_backend="gloo") if a.zero3 else dict(use_cpu=True)),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=word_start_reward(tok),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": make_prompts(64)}),
        processing_class=tok,
        peft_config=peft_config,
    )
    trainer.train()
    # Publish the final weights too, the way the next step's sync would.
    trainer.state.global_step += 1
    trainer.vllm_generation.sync_weights()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    partitioned = sum(1 for q in unwrapped.parameters() if hasattr(q, "ds_shape") and q.numel() == 0)
    if a.zero3:
        import deepspeed

        # Every process takes part in the gather; DeepSpeed's own API, not the code under test.
        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
            trained = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    if not trainer.accelerator.is_main_process:
        return
    if a.peft:
        unwrapped = unwrapped.merge_and_unload()
    if not a.zero3:
        trained = {k: v.detach() for k, v in unwrapped.state_dict().items()}
    ckpt = latest_checkpoint(a.checkpoint_path)
    published = load_file(str(ckpt.path / "model.safetensors"))
    # PEFT: every sync merges and then unmerges the adapter, which leaves float rounding in the
    # base weights (as TRL's vLLM path does), so merged weights agree to rounding, not bits.
    diffs = {
        k: (published[k] - trained[k].to(published[k].dtype)).abs().max().item() for k in published if k in trained
    }
    tolerance = 1e-5 if a.peft else 0.0
    equal = set(published) <= set(trained) and all(d <= tolerance for d in diffs.values())
    missing = sorted(set(trained) - set(published))
    history = [h for h in trainer.state.log_history if "reward" in h]
    Path(a.out).write_text(
        json.dumps(
            {
                "processes": trainer.accelerator.num_processes,
                "history": history,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "partitioned_parameters": partitioned,
                "parameters": sum(1 for _ in unwrapped.parameters()),
                "final_step": ckpt.step,
                "published_equals_trained": equal,
                "max_abs_diff": max(diffs.values()) if diffs else None,
                "extra_published": sorted(set(published) - set(trained)),
                "unpublished_tensors": missing,
            },
            indent=2,
        )
    )


def _use_zero3_on_cpu(work: Path) -> None:
    """Configure accelerate's DeepSpeed plugin for ZeRO-3 on the CPU (before any accelerate state)."""
    config = work / "ds_zero3.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                # Threshold 0: every parameter is partitioned (by default small ones stay whole).
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "bf16": {"enabled": False},
                "fp16": {"enabled": False},
            }
        )
    )
    os.environ.update(
        DS_ACCELERATOR="cpu",
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_DEEPSPEED_CONFIG_FILE=str(config),
        ACCELERATE_DEEPSPEED_ZERO3_INIT="true",
    )
    # Test speed only: DeepSpeed's CPU backend JIT-compiles a shared-memory collective (~2.5 min
    # on 2 cores, then ~25 s of compiler probes per launch); without it collectives use gloo.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


if __name__ == "__main__":
    main()
