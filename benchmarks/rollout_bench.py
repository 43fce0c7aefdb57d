"""Rollout overhead of trainer_hooks, and GRPO step time against TRL's built-in generation.

    ./scripts/run.sh python benchmarks/rollout_bench.py [--repeats 5] [--steps 10]

Part 1, generation overhead: on one real SGLang server (tiny model, CPU), the same
batch (``--prompts`` prompts x ``--n`` completions x ``--max-new-tokens`` tokens,
``ignore_eos`` so every run makes the same number of tokens) goes alternately
through ``trainer_hooks.SGLangGeneration.generate`` (de-duplication, request,
response checks, int coercion, scatter) and through a direct ``POST /generate``
with the same payload. Prints tokens/s of each and the overhead (goal: under 3%).

Part 2, GRPO step time: the demo's GRPO run (``trainer_hooks`` with SGLang
rollouts and a checkpoint sync every step) against ``trl.GRPOTrainer`` with its
built-in transformers generation, same model, data, batch and steps, one after
the other in this process. Prints the median step time of each, the SGLang run's
split (generate / sync / train) and the ratio. ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx


def generation_overhead(model_dir: Path, work: Path, prompts: int, n: int, max_new_tokens: int,
                        repeats: int) -> dict:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_service.sglang_launcher import SGLangServer
    from trainer_hooks import GRPOConfig, SGLangGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    batch = [tokenizer(f"prompt number {i}: def f(x):")["input_ids"] for i in range(prompts)]
    sampling = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    with SGLangServer(model_dir, device="cpu", log_path=work / "sglang.log", die_with_parent=True) as server:
        (work / "ckpt").mkdir()
        args = GRPOConfig(output_dir=str(work / "out"), checkpoint_path=str(work / "ckpt"),
                          sglang_urls=[server.url], expected_replicas=1, use_cpu=True, bf16=False,
                          report_to=[], num_generations=n, per_device_train_batch_size=n)
        gen = SGLangGeneration(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                               Accelerator(cpu=True), tokenizer, args=args, temperature=1.0,
                               max_completion_length=max_new_tokens,
                               generation_kwargs={"ignore_eos": True})
        payload = {"input_ids": batch, "sampling_params": {**sampling, "n": n}, "return_logprob": True}

        def direct() -> int:
            out = httpx.post(f"{server.url}/generate", json=payload, timeout=600).json()
            return sum(len([int(t) for t in item["output_ids"]]) for item in out)

        def hooks() -> int:
            repeated = [p for p in batch for _ in range(n)]
            _, completion_ids, _, _ = gen.generate(repeated, None, n)
            return sum(len(c) for c in completion_ids)

        direct(), hooks()  # warm-up: radix cache and connections, for both
        runs: dict[str, list[float]] = {"direct": [], "trainer_hooks": []}
        for rep in range(repeats):
            order = [("direct", direct), ("trainer_hooks", hooks)]
            for name, fn in (order if rep % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                tokens = fn()
                runs[name].append(tokens / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"tokens_per_batch": prompts * n * max_new_tokens, "tokens_per_s": runs, "median": med,
            "overhead": 1 - med["trainer_hooks"] / med["direct"]}


def trl_baseline_steps(model_dir: Path, work: Path, steps: int, lr: float) -> dict:
    """TRL's GRPOTrainer with transformers generation, the demo's settings."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from trainer_hooks.demo import make_prompts, word_start_reward

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=32,
                          num_generations=8, max_completion_length=16, max_steps=steps,
                          learning_rate=lr, lr_scheduler_type="constant", beta=0.0, temperature=1.0,
                          logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                          bf16=False, disable_tqdm=True, seed=0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=word_start_reward(tokenizer), args=args,
                              train_dataset=Dataset.from_dict({"prompt": make_prompts(max(64, steps * 4))}),
                              processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    return {"step_time": [h["step_time"] for h in history], "rewards": [h["reward"] for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per trainer (part 2)")
    parser.add_argument("--skip-grpo", action="store_true", help="only part 1")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from rollout_service.tiny_model import ensure_tiny_model
    from trainer_hooks.demo import run_demo, time_split

    model_dir = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    results: dict = {"overhead": generation_overhead(model_dir, work, args.prompts, args.n,
                                                     args.max_new_tokens, args.repeats)}
    o = results["overhead"]
    print(f"generation: {args.prompts} prompts x n={args.n} x {args.max_new_tokens} tokens,"
          f" {args.repeats} alternating repeats")
    for k in ("direct", "trainer_hooks"):
        print(f"  {k:<14} {o['median'][k]:>9.0f} tok/s   runs: "
              + " ".join(f"{x:.0f}" for x in o["tokens_per_s"][k]))
    print(f"  trainer_hooks overhead: {100 * o['overhead']:.1f}% (goal: < 3%)")
    if not args.skip_grpo:
        import torch

        threads = torch.get_num_threads()
        sglang = run_demo(work / "demo", steps=args.steps, plot=False)
        torch.set_num_threads(threads)  # run_demo leaves a core to a local CPU SGLang; TRL gets all
        baseline = trl_baseline_steps(model_dir, work, args.steps, sglang["learning_rate"])
        med_s = statistics.median(h["step_time"] for h in sglang["log_history"])
        med_t = statistics.median(baseline["step_time"])
        results["grpo"] = {"sglang": {"median_step_s": med_s, "split": time_split(sglang["log_history"]),
                                      "rewards": sglang["rewards"]},
                           "trl_transformers": {"median_step_s": med_t, "rewards": baseline["rewards"]},
                           "ratio_sglang_over_trl": med_s / med_t}
        split = results["grpo"]["sglang"]["split"]
        print(f"GRPO, tiny model, {args.steps} steps, 32 completions x 16 tokens per step:")
        print(f"  trainer_hooks + SGLang: {med_s:.3f} s/step (generate {split['generate']:.3f},"
              f" sync {split['sync_total']:.3f} [gather {split['sync_gather']:.3f}, write"
              f" {split['sync_write']:.3f}, wait {split['sync_wait']:.3f}], train {split['train']:.3f})")
        print(f"  TRL + transformers generate: {med_t:.3f} s/step")
        print(f"  ratio SGLang path / TRL built-in: {med_s / med_t:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
