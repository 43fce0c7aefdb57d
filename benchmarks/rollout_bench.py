"""Rollout overhead of trainer_hooks, and GRPO step time against TRL's built-in generation.

    ./scripts/run.sh python benchmarks/rollout_bench.py [--repeats 20] [--steps 10]

Part 1, generation overhead: on one real SGLang server (tiny model, CPU), the same
batch (``--prompts`` prompts x ``--n`` completions x ``--max-new-tokens`` tokens,
``ignore_eos`` so every run makes the same number of tokens) goes alternately
through ``trainer_hooks.SGLangGeneration.generate`` (de-duplication, request,
response checks, int coercion, scatter) and through a direct ``POST /generate``
with the same payload, back to back in pairs. Prints tokens/s of each and the
overhead (goal: under 3%) as the median of the paired time ratios with a bootstrap
95% interval. Then, because a shared CPU makes live batches vary by +-15%, it
replays one recorded answer through both clients with no server (an
``httpx.MockTransport``), which times each client's own work exactly: the extra
milliseconds of ``trainer_hooks`` are the overhead any server would see.

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


def generation_overhead(
    model_dir: Path, work: Path, prompts: int, n: int, max_new_tokens: int, repeats: int, replays: int = 50
) -> dict:
    """Part 1: live paired runs against direct /generate, and the client-side cost on a replay."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_service.sglang_launcher import SGLangServer
    from trainer_hooks import GRPOConfig, build_sglang_generation

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    batch = [tokenizer(f"prompt number {i}: def f(x):")["input_ids"] for i in range(prompts)]
    repeated = [p for p in batch for _ in range(n)]
    with SGLangServer(model_dir, device="cpu", log_path=work / "sglang.log", die_with_parent=True) as server:
        (work / "ckpt").mkdir()
        args = GRPOConfig(
            output_dir=str(work / "out"),
            checkpoint_path=str(work / "ckpt"),
            sglang_urls=[server.url],
            expected_replicas=1,
            use_cpu=True,
            bf16=False,
            report_to=[],
            num_generations=n,
            per_device_train_batch_size=n,
        )
        gen = build_sglang_generation(
            AutoModelForCausalLM.from_pretrained(str(model_dir)),
            Accelerator(cpu=True),
            tokenizer,
            args=args,
            temperature=1.0,
            max_completion_length=max_new_tokens,
            generation_kwargs={"ignore_eos": True},
        )
        # Exactly what trainer_hooks sends (its sampling parameters, n, logprobs), sent directly.
        payload = {"input_ids": batch, "sampling_params": {**gen.sampling_params, "n": n}, "return_logprob": True}
        client = httpx.Client(timeout=600)

        def direct_body() -> bytes:
            response = client.post(f"{server.url}/generate", json=payload)
            response.raise_for_status()
            return response.content

        def direct_tokens(body: bytes) -> int:
            return sum(len([int(t) for t in item["output_ids"]]) for item in json.loads(body))

        def hooks() -> int:
            _, completion_ids, _, _ = gen.generate(repeated, None, n)
            return sum(len(c) for c in completion_ids)

        recorded = direct_body()
        hooks()  # warm-up: radix cache and connections, for both
        # Live, paired: each repeat runs both paths back to back (order alternating), and the
        # overhead is the median of the per-pair time ratios, with a bootstrap 95% interval.
        seconds: dict[str, list[float]] = {"direct": [], "trainer_hooks": []}
        for rep in range(repeats):
            order = ["direct", "trainer_hooks"] if rep % 2 == 0 else ["trainer_hooks", "direct"]
            for name in order:
                t0 = time.perf_counter()
                tokens = direct_tokens(direct_body()) if name == "direct" else hooks()
                seconds[name].append(time.perf_counter() - t0)
                assert tokens == prompts * n * max_new_tokens, (name, tokens)
        # Replay: the same recorded answer through the same in-memory transport, no server, so
        # only each client's own work is timed: trainer_hooks' whole generate() (de-duplication,
        # response checks, int coercion, weight-version check, scatter) against a plain client
        # (encode the request, read the JSON and the ids); both pay httpx's request/response work.
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=recorded))
        rollouts = gen.rollouts
        assert rollouts is not None
        rollouts.endpoints.close()  # the benchmark swaps the network for a replay of `recorded`
        rollouts.endpoints = type(rollouts.endpoints)(
            [server.url], request_timeout_s=60.0, vocab_size=rollouts.endpoints._vocab_size, transport=transport
        )
        replay_client = httpx.Client(transport=transport)
        replay = {"direct": [], "trainer_hooks": []}
        for _ in range(replays):
            t0 = time.perf_counter()
            direct_tokens(replay_client.post(f"{server.url}/generate", json=payload).content)
            replay["direct"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hooks()
            replay["trainer_hooks"].append(time.perf_counter() - t0)
        client.close()
        replay_client.close()
        gen.close()
    ratios = [h / d for h, d in zip(seconds["trainer_hooks"], seconds["direct"])]
    low, high = _bootstrap_median_ci(ratios)
    extra_s = statistics.median(replay["trainer_hooks"]) - statistics.median(replay["direct"])
    direct_s = statistics.median(seconds["direct"])
    tokens = prompts * n * max_new_tokens
    return {
        "tokens_per_batch": tokens,
        "seconds": seconds,
        "pair_ratios": ratios,
        "tokens_per_s_median": {k: tokens / statistics.median(v) for k, v in seconds.items()},
        "overhead": statistics.median(ratios) - 1,
        "overhead_ci95": [low - 1, high - 1],
        "replay_s": replay,
        "client_extra_s": extra_s,
        "client_overhead": extra_s / direct_s,
        "response_bytes": len(recorded),
    }


def _bootstrap_median_ci(values: list[float], rounds: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    data = np.asarray(values)
    medians = np.median(rng.choice(data, size=(rounds, len(data)), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def trl_baseline_steps(model_dir: Path, work: Path, steps: int, lr: float) -> dict:
    """TRL's GRPOTrainer with transformers generation, the demo's settings."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from rollout_demo.demo import make_prompts, word_start_reward

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    args = trl.GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=word_start_reward(tokenizer),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": make_prompts(max(64, steps * 4))}),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    return {"step_time": [h["step_time"] for h in history], "rewards": [h["reward"] for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20, help="paired live runs (part 1)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per trainer (part 2)")
    parser.add_argument("--skip-grpo", action="store_true", help="only part 1")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from rollout_demo.demo import run_demo, time_split
    from rollout_service.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    results: dict = {
        "overhead": generation_overhead(model_dir, work, args.prompts, args.n, args.max_new_tokens, args.repeats)
    }
    o = results["overhead"]
    print(
        f"generation: {args.prompts} prompts x n={args.n} x {args.max_new_tokens} tokens"
        f" ({o['tokens_per_batch']} tokens), {args.repeats} paired live runs"
    )
    for k in ("direct", "trainer_hooks"):
        print(
            f"  {k:<14} {o['tokens_per_s_median'][k]:>9.0f} tok/s   batch seconds: "
            + " ".join(f"{x:.2f}" for x in o["seconds"][k])
        )
    low, high = o["overhead_ci95"]
    print(
        f"  live overhead (median of paired ratios): {100 * o['overhead']:+.1f}%"
        f"  [95% CI {100 * low:+.1f}% .. {100 * high:+.1f}%]  (goal: < 3%)"
    )
    print(
        f"  client-side work on a replay of the same {o['response_bytes'] / 1e3:.0f} kB answer: trainer_hooks"
        f" {1e3 * statistics.median(o['replay_s']['trainer_hooks']):.2f} ms vs direct"
        f" {1e3 * statistics.median(o['replay_s']['direct']):.2f} ms per batch;"
        f" extra {1e3 * o['client_extra_s']:.2f} ms = {100 * o['client_overhead']:.2f}% of a"
        f" {statistics.median(o['seconds']['direct']):.2f} s batch"
    )
    if not args.skip_grpo:
        sglang = run_demo(work / "demo", steps=args.steps, plot=False)
        baseline = trl_baseline_steps(model_dir, work, args.steps, sglang["learning_rate"])
        med_s = statistics.median(h["step_time"] for h in sglang["log_history"])
        med_t = statistics.median(baseline["step_time"])
        results["grpo"] = {
            "sglang": {
                "median_step_s": med_s,
                "split": time_split(sglang["log_history"]),
                "rewards": sglang["rewards"],
            },
            "trl_transformers": {"median_step_s": med_t, "rewards": baseline["rewards"]},
            "ratio_sglang_over_trl": med_s / med_t,
        }
        split = results["grpo"]["sglang"]["split"]
        print(f"GRPO, tiny model, {args.steps} steps, 32 completions x 16 tokens per step:")
        print(
            f"  trainer_hooks + SGLang: {med_s:.3f} s/step (generate {split['generate']:.3f},"
            f" sync {split['sync_total']:.3f} [gather {split['sync_gather']:.3f}, write"
            f" {split['sync_write']:.3f}, wait {split['sync_wait']:.3f}], train {split['train']:.3f})"
        )
        print(f"  TRL + transformers generate: {med_t:.3f} s/step")
        print(f"  ratio SGLang path / TRL built-in: {med_s / med_t:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
