"""The weights the trainer publishes: a PEFT model's adapters merged under the base names."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trainer_hooks.weight_gather import iter_full_weights


def test_peft_weights_are_published_merged_under_base_names(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [name for name, _ in base.named_parameters()]
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        before = peft_model(ids).logits
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    published = {name: t.clone() for name, t in iter_full_weights(peft_model)}
    assert list(published) == names
    for name in names:
        torch.testing.assert_close(published[name], expected[name])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(published[q], base.state_dict()[q])  # the adapter really was merged
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, before)  # ...and unmerged afterwards


def test_the_distributed_view_of_accelerators_with_and_without_plugin_fields() -> None:
    from types import SimpleNamespace

    from trainer_hooks.weight_gather import distributed_backend

    zero3 = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None))
    assert distributed_backend(zero3).is_zero3 and distributed_backend(zero3).zero_stage == 3
    # No accelerator, an accelerator without a state, a state without the plugin fields: plain.
    for plain in (None, SimpleNamespace(), SimpleNamespace(state=SimpleNamespace())):
        backend = distributed_backend(plain)
        assert backend.zero_stage == 0 and not backend.is_zero3 and not backend.is_fsdp


def test_an_adapter_not_named_default_publishes_its_modules_to_save_under_base_names(tiny_model_dir: Path) -> None:
    """Only ``modules_to_save.default.`` was stripped: an adapter named otherwise published
    ``lm_head.modules_to_save.policy.weight`` and no ``lm_head.weight`` (every sidecar refused
    every version), and another adapter's copies would have been published too."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [name for name, _ in base.named_parameters()]
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    peft_model = get_peft_model(copy.deepcopy(base), config, adapter_name="policy")
    peft_model.add_adapter("other", config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.1)
    peft_model.set_adapter("policy")
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    published = {name: t.clone() for name, t in iter_full_weights(peft_model)}
    assert list(published) == names
    for name in names:
        torch.testing.assert_close(published[name], expected[name])
    assert not torch.equal(published["lm_head.weight"], base.state_dict()["lm_head.weight"])  # the trained copy


def test_a_quantized_base_is_refused_for_merged_syncs(tiny_model_dir: Path) -> None:
    """A QLoRA base (bitsandbytes): PEFT's merge replaces and re-quantizes the packed weights, so
    the merged sync published the unmerged weights and changed the frozen base; it is refused at
    start-up now, naming adapter sync. (bitsandbytes is not installed here: transformers' own
    marks of a quantized model stand for it.)"""
    from peft import LoraConfig, get_peft_model

    from trainer_hooks.weight_gather import merged_sync_problem

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    assert merged_sync_problem(peft_model) is None
    base.is_loaded_in_4bit = True
    problem = merged_sync_problem(peft_model)
    assert problem is not None and "quantized" in problem and "--lora" in problem
