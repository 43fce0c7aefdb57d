"""What SGLang's repetition penalty costs on the CPU test bed, now that it runs at all.

    ./scripts/run.sh python benchmarks/penalty_bench.py [--pairs 20] [--json OUT]

Before the CPU stand-in's fix (``rollout_service/_cpu_shims/sgl_kernel``: its
``torch.get_device_module`` replacement lacked the ``__wrapped__`` torch._dynamo looks up), any
``repetition_penalty != 1`` request killed the CPU scheduler. The fix keeps SGLang's own
``torch.compile``'d penalty function, so:

* ``live``: one real CPU SGLang server, requests without and with a penalty alternating in pairs
  (order flipped each pair, so background load hits both alike): median per-pair time ratio.
  Requests without a penalty run no code the fix changed.
* ``micro``: SGLang's compiled ``apply_scaling_penalties`` against its uncompiled original
  (what an "eager" workaround would run), per call, on one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

from rollout_service.sglang_launcher import SGLangServer
from rollout_service.tiny_model import ensure_tiny_model

PROMPTS = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(8)]


def generate_s(url: str, penalty: float, n: int, new_tokens: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        f"{url}/generate",
        timeout=900,
        json={
            "input_ids": PROMPTS,
            "sampling_params": {
                "temperature": 1.0,
                "max_new_tokens": new_tokens,
                "n": n,
                "ignore_eos": True,
                "repetition_penalty": penalty,
            },
        },
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def live(pairs: int, n: int, new_tokens: int) -> dict:
    server = SGLangServer(ensure_tiny_model(tied=False), device="cpu", python=sys.executable, die_with_parent=True)
    server.start()
    try:
        server.wait_healthy(900)
        first = generate_s(server.url, 1.1, n, new_tokens)  # includes torch.compile
        generate_s(server.url, 1.0, n, new_tokens)
        plain, penalized, ratios = [], [], []
        for i in range(pairs):
            order = (1.0, 1.1) if i % 2 == 0 else (1.1, 1.0)
            got = {p: generate_s(server.url, p, n, new_tokens) for p in order}
            plain.append(got[1.0])
            penalized.append(got[1.1])
            ratios.append(got[1.1] / got[1.0])
        alive = server.is_running()
    finally:
        server.stop()
    return {
        "pairs": pairs,
        "tokens_per_request": len(PROMPTS) * n * new_tokens,
        "first_penalized_request_s": first,
        "plain_median_s": statistics.median(plain),
        "penalized_median_s": statistics.median(penalized),
        "penalized_over_plain_median": statistics.median(ratios),
        "ratio_quartiles": statistics.quantiles(ratios, n=4),
        "server_alive_after": alive,
    }


def micro() -> dict:
    import torch
    from sglang.srt.sampling.penaltylib import repetition_penalty

    torch.set_num_threads(1)
    compiled = repetition_penalty.apply_scaling_penalties
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None:
        return {"error": "SGLang's apply_scaling_penalties is not a torch.compile wrapper here"}
    out = {}
    for rows, vocab in ((8, 4096), (64, 4096), (64, 151936)):
        logits, scale = torch.randn(rows, vocab), torch.rand(rows, vocab) + 0.5
        medians = {}
        for name, fn in (("compiled", compiled), ("eager", eager)):
            for _ in range(5):
                fn(logits.clone(), scale)
            times = []
            for _ in range(30):
                x = logits.clone()
                t0 = time.perf_counter()
                fn(x, scale)
                times.append(time.perf_counter() - t0)
            medians[name] = statistics.median(times) * 1e6
        out[f"{rows}x{vocab}"] = {
            "compiled_us": round(medians["compiled"], 1),
            "eager_us": round(medians["eager"], 1),
            "eager_over_compiled": round(medians["eager"] / medians["compiled"], 2),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="alternating request pairs (default 20)")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt (8 prompts)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = {"micro": micro(), "live": live(args.pairs, args.n, args.new_tokens)}
    lv = results["live"]
    print(
        f"live: penalty 1.1 vs 1.0, median per-pair ratio {lv['penalized_over_plain_median']:.2f}"
        f" (quartiles {lv['ratio_quartiles'][0]:.2f} / {lv['ratio_quartiles'][2]:.2f}),"
        f" {lv['plain_median_s']:.3f} s vs {lv['penalized_median_s']:.3f} s per"
        f" {lv['tokens_per_request']}-token request; first penalized request"
        f" {lv['first_penalized_request_s']:.2f} s (compiles); server alive: {lv['server_alive_after']}"
    )
    for shape, m in results["micro"].items():
        print(f"micro {shape}: {m}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
