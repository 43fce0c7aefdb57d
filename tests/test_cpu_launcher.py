"""The CPU launcher's SGLang: requests that crashed SGLang 0.5.23's CPU scheduler now work.

`repetition_penalty != 1` reached `apply_scaling_penalties`, which SGLang compiles with
`torch.compile`; in the CPU scheduler that raises `InternalTorchDynamoError` and the server dies.
The CPU stand-in folder's `sitecustomize.py` swaps in the uncompiled function (CPU only).
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
    batch = generate(sglang_server.url, [prompt, [10, 11, 12]], max_new_tokens=16, temperature=1.0, n=2,
                     repetition_penalty=1.1)
    assert len(batch) == 4 and all(len(o["output_ids"]) > 0 for o in batch)
    assert httpx.get(f"{sglang_server.url}/health", timeout=60).status_code == 200
    assert "InternalTorchDynamoError" not in sglang_server.log_tail(400)


def _run_with_shims(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CPU_SHIMS_DIR), os.environ.get("PYTHONPATH", "")]),
                **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full_env)


PROBE = ("import torch; from sglang.srt.sampling.penaltylib import repetition_penalty as rp;"
         " from sglang.srt.sampling.sampling_batch_info import apply_scaling_penalties as imported;"
         " print(hasattr(rp.apply_scaling_penalties, '_torchdynamo_orig_callable'),"
         " hasattr(imported, '_torchdynamo_orig_callable'))")


def test_the_penalty_function_is_uncompiled_wherever_sglang_imports_it_with_the_cpu_shims():
    done = _run_with_shims(PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout
    # Without the fix (kept compiled), the same names are torch.compile wrappers.
    kept = _run_with_shims(PROBE, ROLLOUT_SHIM_KEEP_COMPILED_PENALTIES="1")
    assert kept.stdout.split()[-2:] == ["True", "True"], kept.stdout + kept.stderr[-2000:]


def test_the_uncompiled_penalty_is_the_same_function_of_the_logits():
    code = ("import torch; from sglang.srt.sampling.penaltylib import repetition_penalty as rp;"
            " torch.manual_seed(0); logits = torch.randn(4, 64); pen = torch.rand(4, 64) + 0.5;"
            " want = torch.where(logits < 0, logits * pen, logits / pen); got = logits.clone();"
            " rp.apply_scaling_penalties(got, pen); print(torch.equal(got, want))")
    done = _run_with_shims(code)
    assert done.stdout.strip().endswith("True"), done.stderr[-3000:]


def test_the_shim_leaves_cuda_machines_alone_and_runs_a_shadowed_sitecustomize(tmp_path):
    # With CUDA available the compiled function stays (the folder is never on PYTHONPATH there anyway).
    code = ("import torch, sitecustomize; from types import ModuleType\n"
            "def fresh():\n"
            "    m = ModuleType('m'); m.apply_scaling_penalties = torch.compile(lambda l, s: None); return m\n"
            "print(sitecustomize.make_eager(fresh()))\n"
            "torch.cuda.is_available = lambda: True\n"
            "print(sitecustomize.make_eager(fresh()))\n")
    done = _run_with_shims(code)
    assert done.stdout.split("\n")[-3:-1] == ["['apply_scaling_penalties']", "[]"], done.stdout + done.stderr[-2000:]
    # An interpreter's own sitecustomize, further down the path, still runs.
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.OTHER_SITECUSTOMIZE_RAN = True\n")
    done = subprocess.run([sys.executable, "-c", "import builtins; print(getattr(builtins, 'OTHER_SITECUSTOMIZE_RAN', False))"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(CPU_SHIMS_DIR), str(other)])})
    assert done.stdout.strip() == "True", done.stderr


def test_the_cpu_launcher_puts_the_shims_first_on_pythonpath_for_the_server(tmp_path):
    server = SGLangServer(tmp_path, device="cpu", log_path=tmp_path / "s.log")
    env = server.environment()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(CPU_SHIMS_DIR)
    assert (CPU_SHIMS_DIR / "sitecustomize.py").is_file()
    assert "TORCHDYNAMO_DISABLE" not in env  # only the penalty function loses torch.compile
