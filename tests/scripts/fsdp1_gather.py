"""FSDP1 (accelerate's default FSDP version) gathered into full weights, on CPU processes (gloo).

    torchrun --standalone --nproc_per_node 2 tests/scripts/fsdp1_gather.py --out OUT.json --root DIR [--peft] [--tied]

Wraps the tiny model with ``torch.distributed.fsdp.FullyShardedDataParallel`` (each decoder layer,
then the root, as accelerate's transformer auto-wrap policy does), runs
``trainer_hooks.weight_gather.iter_full_weights`` on every process, publishes on rank 0 and
records what the published checkpoint holds against the unsharded model. With ``--peft`` the
model is first a PEFT LoRA model (trained adapters: random weights) in bf16, wrapped with
``use_orig_params=True`` (as accelerate does for PEFT), and the expected checkpoint is PEFT's own
``merge_and_unload`` of an unsharded copy. With ``--tied`` the model ties its embeddings to its
head (one parameter, drawn once). Each process also records how many FSDP units were unsharded
at once while the walk drew a tensor (``most_units_full``, of ``units``) and the order the
tensors came in against the unwrapped model's ``named_parameters``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp._common_utils import TrainingState
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.tiny_model import ensure_tiny_model
from trainer_hooks.weight_gather import is_fsdp1, iter_full_weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--peft", action="store_true")
    p.add_argument("--tied", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model_dir = ensure_tiny_model(tied=a.tied)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # move the weights away from the saved ones (same on every rank)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    if a.peft:
        import copy

        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).to(torch.bfloat16)
        with torch.no_grad():  # trained adapters (B starts at zero: nothing to merge)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn_like(param) * 0.05)
        source = copy.deepcopy(model).merge_and_unload()
    else:
        source = model
    # What a sync of the unsharded model publishes: its parameters (a tied head once), in order.
    full = {k: v.detach().clone() for k, v in source.named_parameters()}
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
        device_id=torch.device("cpu"),
        use_orig_params=a.peft,
    )
    local = {n: tuple(t.shape) for n, t in wrapped.named_parameters()}
    accelerator = SimpleNamespace(is_main_process=rank == 0, device=torch.device("cpu"), state=None)
    units = FullyShardedDataParallel.fsdp_modules(wrapped)
    order: list[str] = []
    most_full = 0

    def watched():  # how many units are unsharded while each tensor is drawn
        nonlocal most_full
        for name, tensor in iter_full_weights(wrapped, accelerator):
            most_full = max(most_full, sum(u.training_state == TrainingState.SUMMON_FULL_PARAMS for u in units))
            order.append(name)
            yield name, tensor

    tensors = watched()
    result = {
        "rank": rank,
        "is_fsdp1": is_fsdp1(wrapped),
        "local_names": sorted(local)[:3],
        "flat_local": any("_flat_param" in n for n in local),
    }
    if rank == 0:
        published = publish_checkpoint(
            a.root, 1, tensors, config=model_dir / "config.json", max_shard_bytes=256 * 1024
        )  # several shards
        state = {}
        for path in sorted(Path(published.path).glob("*.safetensors")):
            state.update(load_file(str(path)))
        result.update(
            files=published.files,
            names_match=sorted(state) == sorted(full),
            missing=sorted(set(full) - set(state))[:5],
            extra=sorted(set(state) - set(full))[:5],
            shapes_match=all(tuple(state[k].shape) == tuple(full[k].shape) for k in state if k in full),
            values_match=all(torch.equal(state[k], full[k]) for k in state if k in full),
        )
    else:
        result.update(yielded=sum(1 for _ in tensors))  # takes part in the collective gathers
    result.update(units=len(units), most_units_full=most_full, in_model_order=order == list(full), order=order)
    dist.barrier()
    Path(a.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
