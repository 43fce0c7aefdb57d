"""LoRA serving settings of one SGLang server, declared once: CLI flags, defaults and SGLang's args.

``rollout-service serve --lora`` starts SGLang with ``--enable-lora`` so that the sidecar can load
each trained adapter version with ``/load_lora_adapter`` (adapter sync) instead of reloading the
merged model. The defaults serve any adapter TRL/PEFT trains on a Llama/Qwen-style model: every
attention and MLP projection (PEFT's default for Qwen2 is ``q_proj``/``v_proj``; ``all-linear``
is all seven), ranks up to 64, and 4 adapters per batch (the newest version, the ones still
inside the trainer's staleness window, and the base model). On the CPU SGLang's ``torch_native``
LoRA backend is used (its other backends are GPU kernels); on CUDA SGLang picks its own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .checkpoint_format import MAX_ADAPTER_RANK
from .cli_env import SettingFlags, add_env_argument, check_bounds, given_as, setting

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_RANK = 64
DEFAULT_MAX_LORAS_PER_BATCH = 4
MAX_LORAS_PER_BATCH = 1024
"""The most adapters per batch ``serve`` passes on (SGLang sets no limit; each one reserves a slot
in its LoRA memory pool, so far fewer fit in practice)."""
CPU_BACKEND = "torch_native"


def module_list(text: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` (or space-separated) -> ``("q_proj", "v_proj")``; an
    ``ArgumentTypeError`` (a ``ValueError`` argparse would replace by "invalid value") for none."""
    modules = tuple(m for m in text.replace(",", " ").split() if m)
    if not modules:
        raise argparse.ArgumentTypeError(f"no module name in {text!r}: give at least one, e.g. q_proj,v_proj")
    return modules


@dataclass(frozen=True)
class LoraServing:
    """SGLang's LoRA flags for one server (see the module docstring for the defaults).

    Each field is also a flag of ``serve`` and a ``ROLLOUT_*`` variable, used with ``--lora``
    (derived from this declaration: see ``rollout_service.cli_env``).
    """

    max_rank: int = field(
        default=DEFAULT_MAX_RANK,
        metadata=setting(
            "--max-lora-rank", "(with --lora) largest adapter rank SGLang can serve", bounds=(1, MAX_ADAPTER_RANK)
        ),
    )
    target_modules: tuple[str, ...] = field(
        default=DEFAULT_TARGET_MODULES,
        metadata=setting(
            "--lora-target-modules",
            "(with --lora) comma-separated modules adapters may change, or 'all'",
            parse=module_list,
        ),
    )
    max_loras_per_batch: int = field(
        default=DEFAULT_MAX_LORAS_PER_BATCH,
        metadata=setting(
            "--max-loras-per-batch",
            "(with --lora) adapters SGLang keeps in its batch pool, the base model included; at least"
            " max_staleness + 2",
            bounds=(2, MAX_LORAS_PER_BATCH),
        ),
    )
    backend: str | None = field(
        default=None,
        metadata=setting(
            "--lora-backend",
            "(with --lora) SGLang's --lora-backend (default: torch_native on CPU, SGLang's choice on CUDA)",
        ),
    )
    """None: ``torch_native`` on the CPU, SGLang's default on CUDA."""

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise ValueError("--lora-target-modules needs at least one module name (or 'all')")
        if isinstance(self.max_loras_per_batch, int) and self.max_loras_per_batch < 2:
            raise ValueError(
                f"--max-loras-per-batch must be at least 2 (an adapter and the base model),"
                f" got {self.max_loras_per_batch}"
            )
        check_bounds(self)  # --max-lora-rank 1 to 4096, --max-loras-per-batch 2 to 1024

    def sglang_args(self, device: str) -> list[str]:
        """The ``sglang.launch_server`` flags for ``device`` ("cpu" or "cuda")."""
        args = [
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_rank),
            "--lora-target-modules",
            *self.target_modules,
            "--max-loras-per-batch",
            str(self.max_loras_per_batch),
        ]
        backend = self.backend or (CPU_BACKEND if device == "cpu" else None)
        if backend:
            args += ["--lora-backend", backend]
        return args


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """``--lora`` and its settings on a command's parser (flags and ``ROLLOUT_*`` variables)."""
    add_env_argument(
        p,
        "--lora",
        action="store_true",
        help="serve LoRA adapters: start SGLang with --enable-lora so trained adapters are synced"
        " as adapters (POST /load_lora_adapter) instead of merged full checkpoints",
    )
    SettingFlags(LoraServing).add_to(p)


def lora_from_args(args: argparse.Namespace) -> LoraServing | None:
    """The settings ``add_lora_flags`` parsed, or None without ``--lora``; a ValueError naming
    the LoRA settings given without ``--lora`` (on the command line or as variables), which
    would otherwise be dropped unseen."""
    settings = SettingFlags(LoraServing)
    if not getattr(args, "lora", False):
        given = [source for spec in settings.flags if (source := given_as(args, spec.dest)) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} only used with --lora, which is off:"
                " add --lora (or ROLLOUT_LORA=1) to serve LoRA adapters, or remove "
                + ("it" if len(given) == 1 else "them")
            )
        return None
    lora: LoraServing = settings.build(args)
    return lora
