"""TRL trainers that generate with SGLang servers kept in sync through shared-storage checkpoints.

Use :class:`GRPOTrainer` with :class:`GRPOConfig` exactly like TRL's, adding where checkpoints go
and which SGLang servers and sidecars to use::

    from trainer_hooks import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="out", checkpoint_path="/shared/ckpts",
                      sglang_urls=["http://rollout-0:30000"], sidecar_urls=["http://rollout-0:8100"])
    GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward, args=args,
                train_dataset=dataset).train()

:class:`SGLangGeneration` is the backend itself (TRL's ``sync_weights`` / ``generate`` seam);
:func:`build_sglang_generation` builds one outside a trainer, wired from a config.
"""

from .config import GRPOConfig, RLOOConfig
from .sglang_generation import SGLangGeneration
from .trainer import GRPOTrainer, RLOOTrainer, build_sglang_generation

__all__ = ["GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer", "SGLangGeneration", "build_sglang_generation"]
