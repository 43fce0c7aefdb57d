"""GRPO on TL;DR summarisation with SGLang rollouts: the GPU example (as in the original TRL PR).

Qwen2.5-0.5B-Instruct learns to summarise Reddit posts from ``trl-lib/tldr``, rewarded with
ROUGE-L against the reference summary. Rollouts come from one or more ``rollout-service serve``
units; the policy is synced to them through a shared checkpoint directory every step.

On a machine with 2 GPUs (one for SGLang, one for training), from the repository root::

    pip install -e '.[trainer,rollout]' rouge-score
    # GPU 0: SGLang + sidecar
    CUDA_VISIBLE_DEVICES=0 rollout-service serve --model Qwen/Qwen2.5-0.5B-Instruct \\
        --checkpoint-path /tmp/ckpts --port 30000 --sidecar-port 8100 -- --mem-fraction-static 0.6
    # GPU 1: the trainer
    CUDA_VISIBLE_DEVICES=1 python examples/grpo_tldr_gpu.py --checkpoint-path /tmp/ckpts \\
        --sglang-url http://127.0.0.1:30000 --sidecar-url http://127.0.0.1:8100

With 8 GPUs, run ``serve`` on some of them (one unit per GPU, each with its own ports, all on
the same ``--checkpoint-path``), pass every SGLang URL and sidecar URL, and launch the trainer
with ``accelerate launch --num_processes N examples/grpo_tldr_gpu.py ...``. The model and the
dataset come from the Hugging Face Hub, so this needs network access (the CPU demo does not).
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trainer_hooks import GRPOConfig, GRPOTrainer


def rouge_l_reward():
    """ROUGE-L F1 of each completion against the post's reference summary."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

    def rouge_l(completions, completion, **kwargs) -> list[float]:
        # trl-lib/tldr: "prompt" is the post, "completion" the reference TL;DR.
        return [scorer.score(ref, out)["rougeL"].fmeasure for out, ref in zip(completions, completion)]

    return rouge_l


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--checkpoint-path", required=True, help="the directory the sidecars watch")
    p.add_argument("--sglang-url", action="append", required=True, help="repeat for several servers")
    p.add_argument("--sidecar-url", action="append", required=True, help="one per SGLang server")
    p.add_argument("--output-dir", default="runs/grpo-tldr")
    p.add_argument("--max-steps", type=int, default=500)
    a = p.parse_args()
    args = GRPOConfig(
        output_dir=a.output_dir, checkpoint_path=a.checkpoint_path, sglang_urls=a.sglang_url,
        sidecar_urls=a.sidecar_url, max_staleness=0, checkpoint_dtype="bfloat16", keep_checkpoints=3,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=64,
        learning_rate=1e-6, max_steps=a.max_steps, bf16=True, logging_steps=5, report_to=[],
        gradient_checkpointing=True)
    dataset = load_dataset("trl-lib/tldr", split="train")
    trainer = GRPOTrainer(model=a.model, reward_funcs=rouge_l_reward(), args=args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    main()
