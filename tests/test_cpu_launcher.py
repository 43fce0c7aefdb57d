"""The CPU launcher's SGLang: requests that crashed SGLang 0.5.23's CPU scheduler now work.

`repetition_penalty != 1` reached `apply_scaling_penalties`, which SGLang compiles with
`torch.compile`; in the CPU scheduler that raised `InternalTorchDynamoError` and the server died.
The cause was the project's own `sgl_kernel` stand-in: it replaced `torch.get_device_module`
without the `__wrapped__` attribute torch._dynamo registers a handler on. With it restored,
SGLang's compiled penalty runs on the CPU as SGLang intends.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from helpers import generate
from rollout_service.sglang_launcher import CPU_SHIMS_DIR, SGLangServer


@pytest.mark.sglang
def test_repetition_penalty_requests_work_and_penalize_on_the_cpu_server(sglang_server: SGLangServer):
    prompt = [5, 6, 7, 8, 9]
    plain = generate(sglang_server.url, prompt, max_new_tokens=48, ignore_eos=True)
    penalized = generate(sglang_server.url, prompt, max_new_tokens=48, ignore_eos=True, repetition_penalty=2.0)
    assert sglang_server.is_running(), sglang_server.log_tail()
    assert len(penalized["output_ids"]) == 48
    # The penalty really applies: greedy decoding repeats tokens less.
    assert penalized["output_ids"] != plain["output_ids"]
    assert len(set(penalized["output_ids"])) > len(set(plain["output_ids"]))
    # Batched, sampled, n > 1, mixed with requests without a penalty: the server keeps serving.
    batch = generate(
        sglang_server.url, [prompt, [10, 11, 12]], max_new_tokens=16, temperature=1.0, n=2, repetition_penalty=1.1
    )
    assert len(batch) == 4 and all(len(o["output_ids"]) > 0 for o in batch)
    assert httpx.get(f"{sglang_server.url}/health", timeout=60).status_code == 200
    assert "InternalTorchDynamoError" not in sglang_server.log_tail(400)
    assert "TORCHDYNAMO_DISABLE" not in sglang_server.environment()


def _run_with_shims(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import sgl_kernel\n" + code,
            str(CPU_SHIMS_DIR),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # subprocesses with torch start-ups: several seconds
def test_torch_compile_works_beside_the_cpu_stand_in():
    # The root cause: the stand-in replaced torch.get_device_module without the `__wrapped__`
    # that torch._dynamo registers its handler on, so every torch.compile in the server raised.
    done = _run_with_shims(
        "import torch\n"
        "@torch.compile(dynamic=True)\n"
        "def apply_scaling_penalties(logits, scaling_penalties):\n"
        "    logits[:] = torch.where(logits < 0, logits * scaling_penalties, logits / scaling_penalties)\n"
        "torch.manual_seed(0); logits = torch.randn(4, 64); pen = torch.rand(4, 64) + 0.5\n"
        "want = torch.where(logits < 0, logits * pen, logits / pen); got = logits.clone()\n"
        "apply_scaling_penalties(got, pen); print('equal', torch.allclose(got, want))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["equal", "True"], done.stdout


def test_the_stand_ins_get_device_module_still_answers_cpu_and_keeps_torchs_attributes():
    done = _run_with_shims(
        "import torch; g = torch.get_device_module\n"
        "print(g() is torch.cpu, g('cpu') is torch.cpu, callable(g.__wrapped__), callable(g.cache_clear))\n"
    )
    assert done.stdout.split()[-4:] == ["True", "True", "True", "True"], done.stdout + done.stderr[-2000:]


def test_the_cpu_launcher_puts_the_shims_first_on_pythonpath_for_the_server(tmp_path):
    server = SGLangServer(tmp_path, device="cpu", log_path=tmp_path / "s.log")
    env = server.environment()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(CPU_SHIMS_DIR)
    assert "TORCHDYNAMO_DISABLE" not in env  # torch.compile stays on: SGLang's compiled kernels run
