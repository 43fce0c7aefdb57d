"""Rollout side of the SGLang checkpoint-sync service.

The trainer publishes safetensors checkpoints under a checkpoint root (see
:mod:`rollout_service.checkpoint_format`); a sidecar beside each SGLang server
(:mod:`rollout_service.sidecar`) validates each new one and loads it with
SGLang's ``/update_weights_from_disk``. This package must import without torch
or SGLang so that the sidecar container stays slim.
"""

__version__ = "0.1.0"
