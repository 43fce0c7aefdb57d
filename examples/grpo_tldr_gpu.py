"""GRPO on TL;DR summarisation with SGLang rollouts: the GPU example (as in the original TRL PR).

Qwen2.5-0.5B-Instruct learns to summarise Reddit posts from ``trl-lib/tldr``, rewarded with
ROUGE-L against the reference summary. Rollouts come from one or more ``rollout-service serve``
units; the policy is synced to them through a shared checkpoint directory every step.

On a machine with 2 GPUs (one for SGLang, one for training), from the repository root::

    pip install -e '.[trainer,rollout,examples]'
    # GPU 0: SGLang + sidecar
    CUDA_VISIBLE_DEVICES=0 rollout-service serve --model Qwen/Qwen2.5-0.5B-Instruct \\
        --checkpoint-path /tmp/ckpts --port 30000 --sidecar-port 8100 -- --mem-fraction-static 0.6
    # GPU 1: the trainer
    CUDA_VISIBLE_DEVICES=1 python examples/grpo_tldr_gpu.py --device cuda --checkpoint-path /tmp/ckpts \\
        --sglang-url http://127.0.0.1:30000 --sidecar-url http://127.0.0.1:8100

With 8 GPUs, run ``serve`` on some of them (one unit per GPU, each with its own ports, all on
the same ``--checkpoint-path``), pass every SGLang URL and sidecar URL (or, for replicas behind one
Service, its URL and ``--expected-replicas N``: the trainer then counts the replicas' ack files, as
the Kubernetes GPU overlay does), and launch the trainer
with ``CUDA_VISIBLE_DEVICES=<the other GPUs> accelerate launch --num_processes N
examples/grpo_tldr_gpu.py --device cuda ...`` (README, "Install on GPU machines"). ``--device cuda``
fails at once when torch sees no GPU (e.g. an NVIDIA driver older than 580 under torch
2.14.1+cu130) instead of training on the CPU. The model and the
dataset come from the Hugging Face Hub, so this needs network access; ``--model`` and
``--dataset`` also take local paths (a model directory; a JSON-lines file or a
``save_to_disk`` folder with ``prompt`` and ``completion`` columns), which is how the test
suite runs this script on CPU with the tiny model.

Credentials, when the rollout side has them (compose and Kubernetes do): the sidecars' ``POST
/sync`` token and SGLang's ``--api-key``, from ``ROLLOUT_TOKEN`` and ``ROLLOUT_SGLANG_API_KEY`` (the
variables the sidecar and ``rollout-service demo`` read) or ``--token`` / ``--sglang-api-key``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset, load_from_disk

from trainer_hooks import GRPOConfig, GRPOTrainer

TOKEN_ENV = "ROLLOUT_TOKEN"
"""The sidecars' ``POST /sync`` token (GRPOConfig ``sidecar_token``), as the sidecar reads it."""
SGLANG_API_KEY_ENV = "ROLLOUT_SGLANG_API_KEY"
"""SGLang's ``--api-key`` (GRPOConfig ``sglang_api_token``), as the sidecar reads it."""

REFERENCE_COLUMN = "reference_summary"
"""trl-lib/tldr's ``completion`` column, renamed: TRL keeps ``prompt``/``completion`` columns out
of the keyword arguments it passes to reward functions."""


def rouge_l_reward():
    """ROUGE-L F1 of each completion against the post's reference summary."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

    def rouge_l(completions: list[str], reference_summary: list[str], **kwargs: Any) -> list[float]:
        return [scorer.score(ref, out)["rougeL"].fmeasure for out, ref in zip(completions, reference_summary)]

    return rouge_l


def load_tldr(name_or_path: str) -> Dataset:
    """The training split of ``name_or_path`` (Hub name, JSON-lines file or saved dataset folder)."""
    path = Path(name_or_path)
    if path.is_file():
        dataset = load_dataset("json", data_files=str(path), split="train")
    elif path.is_dir():
        dataset = load_from_disk(str(path))
    else:
        dataset = load_dataset(name_or_path, split="train")
    missing = {"prompt", "completion"} - set(dataset.column_names)
    if missing:
        raise SystemExit(
            f"--dataset {name_or_path}: missing column(s) {sorted(missing)}; the TL;DR format has a "
            "'prompt' (the post) and a 'completion' (the reference summary)"
        )
    return dataset.rename_column("completion", REFERENCE_COLUMN)


def resolve_device(requested: str) -> str:
    """ "cuda" or "cpu" for ``--device``; never a silent CPU fallback on a machine with GPUs.

    ``auto`` is CUDA when torch sees a GPU, the CPU when the machine has none, and an error when
    nvidia-smi lists GPUs that torch cannot use (a driver older than torch's CUDA build needs, or a
    CPU-only torch). ``cuda`` insists on a GPU; ``cpu`` trains on the CPU on purpose.
    """
    from rollout_service.sglang_launcher import cuda_unavailable_message, listed_gpus

    if requested not in ("auto", "cuda", "cpu"):
        raise SystemExit(f"--device must be auto, cuda or cpu, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    gpus = listed_gpus()
    if requested == "cuda" or gpus:
        raise SystemExit("error: " + cuda_unavailable_message(gpus, f"--device {requested}", torch.__version__))
    return "cpu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="Hub name or local model directory")
    p.add_argument("--dataset", default="trl-lib/tldr", help="Hub name, JSON-lines file or saved dataset folder")
    p.add_argument("--checkpoint-path", required=True, help="the directory the sidecars watch")
    p.add_argument("--sglang-url", action="append", required=True, help="repeat for several servers")
    wait = p.add_mutually_exclusive_group(required=True)
    wait.add_argument(
        "--sidecar-url",
        action="append",
        help="one per SGLang server: each one's GET /wait confirms each checkpoint (not a Service that"
        " spreads calls over several replicas: use --expected-replicas there)",
    )
    wait.add_argument(
        "--expected-replicas",
        type=int,
        help="wait until this many replicas acknowledge each checkpoint in the checkpoint path's acks/"
        " folder (replicas behind one Service or load balancer)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="auto: CUDA when torch sees a GPU, the CPU on a machine without GPUs, an error"
        " when nvidia-smi lists GPUs torch cannot use; cuda: require a GPU",
    )
    p.add_argument("--output-dir", default="runs/grpo-tldr")
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--per-device-train-batch-size", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    # No default shown: --help must not print a secret taken from the environment.
    p.add_argument(
        "--token",
        default=None,
        help=f"the sidecars' POST /sync token; when not given, ${TOKEN_ENV} (prefer the variable: a command"
        " line is visible to every user of the machine)",
    )
    p.add_argument(
        "--sglang-api-key",
        default=None,
        help=f"the --api-key SGLang was started with; when not given, ${SGLANG_API_KEY_ENV} (prefer the variable)",
    )
    p.add_argument(
        "--checkpoint-dtype",
        default=None,
        help="dtype of the published checkpoints (default: bfloat16 on GPU, the model's on CPU)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    on_gpu = resolve_device(a.device) == "cuda"
    checkpoint_dtype = a.checkpoint_dtype or ("bfloat16" if on_gpu else None)
    dataset = load_tldr(a.dataset)
    # An empty variable counts as unset (as for every ROLLOUT_* variable).
    sidecar_token = a.token or os.environ.get(TOKEN_ENV) or None
    sglang_api_token = a.sglang_api_key or os.environ.get(SGLANG_API_KEY_ENV) or None
    args = GRPOConfig(
        output_dir=a.output_dir,
        checkpoint_path=a.checkpoint_path,
        sglang_urls=a.sglang_url,
        sidecar_urls=a.sidecar_url or [],
        expected_replicas=a.expected_replicas,
        max_staleness=0,
        checkpoint_dtype=checkpoint_dtype,
        keep_checkpoints=3,
        per_device_train_batch_size=a.per_device_train_batch_size,
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        learning_rate=a.learning_rate,
        max_steps=a.max_steps,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        logging_steps=1 if a.max_steps < 20 else 5,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=True,
        sidecar_token=sidecar_token,
        sglang_api_token=sglang_api_token,
    )
    trainer = GRPOTrainer(model=a.model, reward_funcs=rouge_l_reward(), args=args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    main()
