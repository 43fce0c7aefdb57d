"""Random-weight Qwen2 models of a chosen size in bfloat16, built locally and cached (benchmarks).

Benchmarks of weight sync need real models that both transformers and SGLang load, at sizes
of about 0.5-2 GB, without a model hub. `ensure_bench_model(gb)` writes one: a seeded
`Qwen2ForCausalLM` whose layer shapes are those of a real Qwen2 model (0.5B, 1.5B or 3B
dimensions, picked by size), with as many layers as fill the byte budget, saved with
`save_pretrained` in bfloat16 beside the tiny model's tokenizer files (so the vocabulary matches
the tokenizer). Models are cached under `~/.cache/rollout-service/bench-models/` and built in a
temporary sibling folder that is renamed into place, so a folder that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout_service.cached_build import build_once

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when the files `make_bench_model` writes change for the same arguments."""

DEFAULT_CACHE_DIR = Path("~/.cache/rollout-service/bench-models")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Files copied from the tiny model folder (those that exist)."""


@dataclass(frozen=True)
class LayerShape:
    """The dimensions of one Qwen2 family member's decoder layers."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention with q/k/v biases, MLP, two norms)."""
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + self.hidden + 2 * kv
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden


SHAPES = (
    (0.75, LayerShape("qwen2-0.5b", 896, 4864, 14, 2)),
    (1.5, LayerShape("qwen2-1.5b", 1536, 8960, 12, 2)),
    (float("inf"), LayerShape("qwen2.5-3b", 2048, 11008, 16, 2)),
)
"""(largest size in GB, layer shape): real dimensions, so tensor sizes look like a real model's."""


@dataclass(frozen=True)
class BenchModelSpec:
    """Everything that determines a bench model's files (its cache key)."""

    gb: float
    shape: LayerShape
    num_layers: int
    vocab_size: int
    seed: int
    format_version: int = FORMAT_VERSION

    def expected_bytes(self) -> int:
        """bf16 bytes of the weights: the layers, untied embedding and lm_head, final norm."""
        params = (
            self.num_layers * self.shape.layer_params() + 2 * self.vocab_size * self.shape.hidden + self.shape.hidden
        )
        return 2 * params


def plan_bench_model(gb: float, vocab_size: int, seed: int = 0) -> BenchModelSpec:
    """Pick the layer shape for `gb` and the layer count whose bf16 weights come closest to it."""
    if gb <= 0:
        raise ValueError(f"model size must be a positive number of GB, got {gb}")
    shape = next(s for limit, s in SHAPES if gb <= limit)
    fixed = 2 * (2 * vocab_size * shape.hidden + shape.hidden)
    per_layer = 2 * shape.layer_params()
    layers = max(1, round((gb * 1e9 - fixed) / per_layer))
    return BenchModelSpec(gb=gb, shape=shape, num_layers=layers, vocab_size=vocab_size, seed=seed)


def make_bench_model(out_dir: Path, spec: BenchModelSpec, tokenizer_dir: Path) -> Path:
    """Write the model of `spec` (bf16, seeded) and the tokenizer files of `tokenizer_dir`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = json.loads((tokenizer_dir / "config.json").read_text())
    shape = spec.shape
    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
        use_sliding_window=False,
    )
    torch.manual_seed(spec.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never hold a float32 copy of a 2 GB model
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.config.dtype = torch.bfloat16
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return out_dir


def ensure_bench_model(gb: float, *, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached bf16 Qwen2 model of about `gb` GB, building it first if needed."""
    from rollout_service.tiny_model import ensure_tiny_model

    tokenizer_dir = ensure_tiny_model()
    vocab = int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])
    spec = plan_bench_model(gb, vocab, seed)
    key = json.dumps(asdict(spec), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR.expanduser()
    final = root / f"qwen2-bf16-{gb:g}gb-{digest}"
    if final.is_dir():
        return final
    logger.info(
        "building %s: %d layers of %s, vocab %d, ~%.2f GB bf16",
        final.name,
        spec.num_layers,
        spec.shape.name,
        spec.vocab_size,
        spec.expected_bytes() / 1e9,
    )

    def build(staging: Path) -> None:
        make_bench_model(staging, spec, tokenizer_dir)
        (staging / "bench_model_spec.json").write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))

    return build_once(final, build)
