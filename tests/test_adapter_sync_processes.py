"""LoRA adapter sync with several processes (DDP): only the main process asks the servers whether
adapter sync applies, so every process learns its answer, and a process that does not publish
leaves its base weights alone at a sync. (Merging the adapter in and out rounds bf16 base weights
away from the main process's copy, and DDP never syncs frozen parameters again.)"""

from __future__ import annotations

import types

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trainer_hooks import trainer
from trainer_hooks.sglang_generation import SGLangGeneration


def _not_main(num_processes: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        is_main_process=False, num_processes=num_processes, process_index=1, device=torch.device("cpu"), state=None
    )


def test_a_process_that_does_not_publish_the_adapter_never_merges_it(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, config)
    merges: list[int] = []
    real_merge = model.merge_adapter

    def counted_merge(*args, **kwargs):
        merges.append(1)
        return real_merge(*args, **kwargs)

    model.merge_adapter = counted_merge
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    step = [0]
    gen = SGLangGeneration(model, _not_main(), None, syncs_adapters=True, current_step=lambda: step[0])
    for s in range(1, 6):
        step[0] = s
        gen.sync_weights()
    assert merges == []
    assert all(torch.equal(p.detach(), base[n]) for n, p in model.named_parameters() if n in base)


def test_every_process_learns_whether_the_main_process_syncs_adapters(monkeypatch) -> None:
    sent: list[list] = []

    def broadcast(box: list, from_process: int = 0) -> list:
        assert from_process == 0 and box == [None]  # the other processes send nothing of their own
        sent.append(box)
        box[0] = True  # what the main process found
        return box

    monkeypatch.setattr(trainer, "broadcast_object_list", broadcast)
    assert trainer._as_the_main_process_says(_not_main(num_processes=2), False) is True
    assert len(sent) == 1
    assert trainer._as_the_main_process_says(_not_main(num_processes=1), False) is False  # one process: no collective
