"""``rollout-service demo``: a GRPO run with SGLang rollouts and checkpoint sync, on one machine.

It makes (or uses) a model, starts ``rollout-service serve`` (SGLang + sidecar)
unless ``--sglang-url``/``--sidecar-url`` point at a running stack, and trains
GRPO for ``--steps`` steps on a task a tiny random model can learn: **start new
words** (the reward is the share of completion tokens that begin with a space,
about 1/3 for the untrained tiny model). Every step publishes a checkpoint that
the sidecar loads before the next rollouts. It writes ``summary.json`` (per-step
reward, sync timings, step time split) and ``demo.png`` to ``--output-dir``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from rollout_service.process_group import ProcessGroup
from rollout_service.sglang_launcher import free_port

log = logging.getLogger(__name__)

WORDS = (
    "the data file import class return value list self path name error test string"
    " module open read write print format number result object type index key"
).split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Short code-and-prose prompts in the tiny tokenizer's domain (Python sources)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7))) for _ in range(n)]


def word_start_reward(tokenizer: Any) -> Callable[..., list[float]]:
    """Reward: the share of completion tokens that start a new word (byte-level 'Ġ' prefix)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    starts = {i for i, t in enumerate(tokens) if t and t.startswith("Ġ")}

    def new_words(completions: Any, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [sum(int(t) in starts for t in ids) / max(len(ids), 1) for ids in completion_ids]

    return new_words


class ServeProcess:
    """``rollout-service serve`` (SGLang + sidecar) as a process group, for the demo's rollouts."""

    def __init__(
        self,
        model: Path,
        checkpoint_path: Path,
        log_path: Path,
        device: str,
        startup_timeout_s: float = 600.0,
        *,
        token: str | None = None,
        sglang_api_key: str | None = None,
    ):
        self.port, self.sidecar_port = free_port(), free_port()
        self.sglang_url = f"http://127.0.0.1:{self.port}"
        self.sidecar_url = f"http://127.0.0.1:{self.sidecar_port}"
        self.sglang_log = log_path.with_name("sglang.log")
        # The credentials go to `serve` through its variables (a command line is visible to every
        # user); SGLang itself takes its key only as a flag (after `--`).
        env = dict(os.environ)
        sglang_flags: list[str] = []
        if token:
            env["ROLLOUT_TOKEN"] = token
        if sglang_api_key:
            env["ROLLOUT_SGLANG_API_KEY"] = sglang_api_key
            sglang_flags = ["--", "--api-key", sglang_api_key]
        self.group = ProcessGroup(
            [
                sys.executable,
                "-m",
                "rollout_service.cli",
                "serve",
                "--model",
                str(model),
                "--checkpoint-path",
                str(checkpoint_path),
                "--port",
                str(self.port),
                "--sidecar-port",
                str(self.sidecar_port),
                "--device",
                device,
                "--health-interval",
                "0.5",
                "--replica-id",
                "demo",
                # The run's own stage: two demos on one machine must not share one (it is locked).
                "--stage-dir",
                str(log_path.parent / "stage"),
                "--startup-timeout",
                str(startup_timeout_s),
                "--sglang-log",
                str(self.sglang_log),
                *sglang_flags,
            ],
            log_path,
            name="rollout-service serve",
            env=env,
            die_with_parent=True,
        )
        self.group.start()

    def wait_ready(self, timeout_s: float, progress_grace_s: float = 120.0) -> None:
        """Wait for the sidecar's /readyz. ``serve`` enforces SGLang's start-up timeout itself
        (waiting on while SGLang shows progress); this waits as long as ``serve`` runs and its
        logs keep growing, and gives up ``progress_grace_s`` after they stop past ``timeout_s``.

        Raises:
            RuntimeError: ``serve`` exited (``ProcessExitedError``).
            TimeoutError: not ready in time (``StartTimeoutError``); the message names the flag.
        """

        def fatal(client: httpx.Client) -> str | None:  # e.g. a stage another sidecar holds
            report = client.get(f"{self.sidecar_url}/status").json().get("fatal")
            return f"{report['reason']}: {report['message']}" if report else None

        self.group.wait_http(
            f"{self.sidecar_url}/readyz",
            timeout_s,
            progress_grace_s=progress_grace_s,
            progress_logs=[self.sglang_log],
            failed=fatal,
            timeout_hint="raise the start-up timeout (serve --startup-timeout)",
        )

    def stop(self) -> None:
        self.group.stop(60.0)


def run_demo(
    output_dir: Path,
    *,
    model: Path | None = None,
    steps: int = 20,
    learning_rate: float = 2e-2,
    num_generations: int = 8,
    prompts_per_step: int = 4,
    max_completion_length: int = 16,
    sglang_url: str | None = None,
    sidecar_url: str | None = None,
    checkpoint_path: Path | None = None,
    device: str = "cpu",
    seed: int = 0,
    plot: bool = True,
    startup_timeout_s: float = 600.0,
    sidecar_token: str | None = None,
    sglang_api_token: str | None = None,
) -> dict[str, Any]:
    """Train, then write ``summary.json`` (+ ``demo.png``) into ``output_dir``; return the summary.

    ``sidecar_token`` and ``sglang_api_token`` are GRPOConfig's: the sidecars' ``POST /sync`` token
    and SGLang's ``--api-key`` (given to the ``serve`` the demo starts, when it starts one).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from rollout_service.tiny_model import ensure_tiny_model
    from trainer_hooks import GRPOConfig, GRPOTrainer

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    model_dir = Path(model) if model else ensure_tiny_model(tied=False)
    checkpoint_path = Path(checkpoint_path or output_dir / "checkpoints")
    checkpoint_path.mkdir(parents=True, exist_ok=True)
    serve = None
    if sglang_url is None:
        print(f"starting SGLang + sidecar on {model_dir} (log: {output_dir / 'serve.log'})", flush=True)
        serve = ServeProcess(
            model_dir,
            checkpoint_path,
            output_dir / "serve.log",
            device,
            startup_timeout_s,
            token=sidecar_token,
            sglang_api_key=sglang_api_token,
        )
        sglang_url, sidecar_url = serve.sglang_url, serve.sidecar_url
    try:
        if serve is not None:
            serve.wait_ready(startup_timeout_s)
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        dataset = Dataset.from_dict({"prompt": make_prompts(max(64, steps * prompts_per_step), seed)})
        args = GRPOConfig(
            output_dir=str(output_dir / "trainer"),
            checkpoint_path=str(checkpoint_path),
            sglang_urls=[sglang_url],
            sidecar_urls=[sidecar_url] if sidecar_url else [],
            expected_replicas=None if sidecar_url else 1,
            per_device_train_batch_size=prompts_per_step * num_generations,
            num_generations=num_generations,
            max_completion_length=max_completion_length,
            max_steps=steps,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            beta=0.0,
            temperature=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=seed,
            use_cpu=device == "cpu",
            bf16=False,
            disable_tqdm=True,
            sync_timeout=300.0,
            keep_checkpoints=3,
            # fp32 master weights, bf16 checkpoints as deltas against the previous version.
            checkpoint_dtype="bfloat16",
            checkpoint_delta=True,
            sidecar_token=sidecar_token,
            sglang_api_token=sglang_api_token,
        )
        step_times: list[float] = []

        class Progress(TrainerCallback):
            def __init__(self) -> None:
                self.t = time.perf_counter()

            def on_step_end(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
                now = time.perf_counter()
                step_times.append(now - self.t)
                self.t = now

            def on_log(self, args_: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "reward" in logs:
                    nan = float("nan")
                    print(
                        f"  step {state.global_step:>3}/{steps}  reward {logs['reward']:.3f}"
                        f"  generate {logs.get('sglang/generate_s', nan):.2f} s"
                        f"  sync {logs.get('sglang/sync_total_s', nan):.2f} s"
                        f"  step {logs.get('step_time', nan):.2f} s",
                        flush=True,
                    )

        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=word_start_reward(tokenizer),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Progress()],
        )
        trainer.remove_callback(PrinterCallback)  # Progress prints one line per step instead
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    finally:
        if serve is not None:
            serve.stop()
    history = [h for h in trainer.state.log_history if "reward" in h]
    summary: dict[str, Any] = {
        "model": str(model_dir),
        "steps": steps,
        "learning_rate": learning_rate,
        "num_generations": num_generations,
        "prompts_per_step": prompts_per_step,
        "max_completion_length": max_completion_length,
        "train_seconds": wall,
        "rewards": [h["reward"] for h in history],
        "step_seconds": step_times,
        "sync": {
            k: [h.get(k) for h in history] for k in sorted({k for h in history for k in h if k.startswith("sglang/")})
        },
        "log_history": history,
    }
    summary["time_split_median_s"] = time_split(history)
    summary["checkpoint_bytes"] = sync_bytes(history)
    r = summary["rewards"]
    k = max(1, len(r) // 5)
    summary["reward_first"] = sum(r[:k]) / k if r else None
    summary["reward_last"] = sum(r[-k:]) / k if r else None
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if plot:
        _plot(summary, output_dir / "demo.png")
    written = summary["checkpoint_bytes"]
    if written["full_mb"]:
        print(
            f"checkpoint sync wrote {written['written_mb']:.1f} MB where full checkpoints would be"
            f" {written['full_mb']:.1f} MB ({written['saved_fraction']:.0%} saved; {written['deltas']} of"
            f" {written['syncs']} syncs were deltas)",
            flush=True,
        )
    split = summary["time_split_median_s"]
    print("median step time split: " + ", ".join(f"{k} {v:.3f} s" for k, v in split.items()))
    print(
        f"reward {summary['reward_first']:.3f} (first {k} steps) -> {summary['reward_last']:.3f}"
        f" (last {k}); {wall:.1f} s for {steps} steps; wrote {output_dir / 'summary.json'}"
        + (f" and {output_dir / 'demo.png'}" if plot else ""),
        flush=True,
    )
    return summary


def sync_bytes(history: list[dict[str, Any]]) -> dict[str, float]:
    """What the syncs wrote to the checkpoint root against what full checkpoints would have."""
    written = sum(float(h.get("sglang/sync_mb") or 0.0) for h in history)
    full = sum(float(h.get("sglang/sync_full_mb") or 0.0) for h in history)
    syncs = sum(1 for h in history if h.get("sglang/sync_mb") is not None)
    deltas = sum(1 for h in history if h.get("sglang/sync_delta"))
    return {
        "written_mb": written,
        "full_mb": full,
        "saved_fraction": 1 - written / full if full else 0.0,
        "syncs": syncs,
        "deltas": deltas,
    }


def time_split(history: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per step: generate, sync (gather, write, wait), train (the rest), total."""
    import statistics

    def med(key: str) -> float:
        values = [float(h[key]) for h in history if h.get(key) is not None]
        return statistics.median(values) if values else 0.0

    split = {
        "generate": med("sglang/generate_s"),
        "sync_gather": med("sglang/sync_gather_s"),
        "sync_write": med("sglang/sync_write_s"),
        "sync_wait": med("sglang/sync_wait_s"),
        "sync_total": med("sglang/sync_total_s"),
        "step": med("step_time"),
    }
    split["train"] = max(0.0, split["step"] - split["generate"] - split["sync_total"])
    return split


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(summary["rewards"]) + 1))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, summary["rewards"], marker="o", ms=3)
    ax1.set_ylabel("reward (share of new-word tokens)")
    ax1.set_title("GRPO with SGLang rollouts and checkpoint sync")
    for key, label in (
        ("sglang/sync_total_s", "sync total"),
        ("sglang/sync_write_s", "write"),
        ("sglang/sync_wait_s", "wait for replicas"),
    ):
        values = summary["sync"].get(key)
        if values and any(v is not None for v in values):
            ax2.plot(steps[: len(values)], [float("nan") if v is None else v for v in values], marker=".", label=label)
    ax2.set_ylabel("seconds")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
