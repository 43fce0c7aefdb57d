"""Tests against a real SGLang server on the CPU: the HTTP answers the rollout path relies on,
agreement with transformers, and the launcher's start-up failure and shutdown behaviour; and the
launcher's settings, which start no server (so they are not marked ``sglang`` and run in fast runs)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from helpers import generate
from rollout_service.sglang_launcher import SGLangServer, SGLangStartError

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Queue:\n    def __init__(self):",
    "# Copyright",
]


def _encode(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.encode(text) for text in texts]


@pytest.mark.sglang
def test_generate_batch_returns_int_token_ids_with_matching_logprobs(sglang_server_at_base, tiny_model_dir):
    prompts = _encode(tiny_model_dir, PROMPTS[:2])
    out = generate(
        sglang_server_at_base.url, prompts, max_new_tokens=8, temperature=1.0, n=2, return_logprob=True, ignore_eos=True
    )

    assert isinstance(out, list) and len(out) == len(prompts) * 2
    for item in out:
        ids = item["output_ids"]
        assert len(ids) == 8
        assert all(type(token) is int for token in ids), ids
        meta = item["meta_info"]
        logprobs = meta["output_token_logprobs"]
        assert [entry[1] for entry in logprobs] == ids
        assert all(isinstance(entry[0], float) and entry[0] <= 0.0 for entry in logprobs)
        assert meta["weight_version"] == "default"


@pytest.mark.sglang
def test_greedy_generation_matches_transformers(sglang_server_at_base, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    max_new_tokens = 24
    prompts = _encode(tiny_model_dir, PROMPTS)
    out = generate(
        sglang_server_at_base.url,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        ignore_eos=True,
        min_new_tokens=max_new_tokens,
    )
    served = [item["output_ids"] for item in out]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            result = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
            )
            expected.append(result[0, len(ids) :].tolist())

    assert served == expected


@pytest.mark.sglang
def test_wait_healthy_reports_exit_code_and_log_when_model_path_is_bogus(tmp_path):
    bogus = tmp_path / "not-a-model"
    bogus.mkdir()
    (bogus / "README.txt").write_text("no config.json here\n")
    server = SGLangServer(bogus, device="cpu", python=sys.executable, log_path=tmp_path / "server.log")
    server.start()
    try:
        with pytest.raises(SGLangStartError) as caught:
            server.wait_healthy(timeout_s=300)
    finally:
        server.stop()
    message = str(caught.value)
    assert "exited with code" in message  # the exit ended the wait, not the 300 s timeout
    assert "last log lines" in message
    assert server.log_tail(40).strip() and server.log_tail(40).strip()[-200:] in message


@pytest.mark.sglang
def test_stop_leaves_no_process_of_the_group_alive(tiny_model_dir, tmp_path):
    server = SGLangServer(tiny_model_dir, device="cpu", python=sys.executable, log_path=tmp_path / "server.log")
    server.start()
    try:
        server.wait_healthy(timeout_s=300)
        pgid = server.pgid
        assert pgid is not None
        members = _group_members(pgid)
        assert len(members) >= 2, f"expected the server and its scheduler children, found {members}"
    finally:
        server.stop()

    assert not server.is_running()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or _pgid_of(pid) != pgid


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _pgid_of(int(entry.name)) == pgid:
            members.append(int(entry.name))
    return members


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


@pytest.mark.sglang
def test_idle_cpu_server_sleeps_instead_of_busy_polling(sglang_server_at_base):
    # The launcher passes --sleep-on-idle on CPU: an idle scheduler that busy-polls burns a whole
    # core (95% measured), which starves a trainer on the same CPU. Sleeping, it uses ~1%.
    import psutil

    assert "--sleep-on-idle" in sglang_server_at_base.command()
    generate(sglang_server_at_base.url, [1, 2, 3], max_new_tokens=2)  # served, then idle
    children = psutil.Process(sglang_server_at_base.pid).children(recursive=True)
    schedulers = [p for p in children if "scheduler" in p.name()]
    assert schedulers, [p.name() for p in children]
    time.sleep(1.0)
    before = [sum(p.cpu_times()[:2]) for p in schedulers]
    t0 = time.monotonic()
    time.sleep(5.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(schedulers, before)]
    idle_s = time.monotonic() - t0
    # Not a speed measure: whether the idle scheduler sleeps or spins. Spinning, it runs whenever it
    # gets a core (half of the idle time or more even with two cores shared by four busy processes);
    # sleeping, it runs ~1% of it. A fifth lies far from both.
    assert max(used) < idle_s / 5, (used, idle_s)
    # The trainer reads the setting back and sees no reason to warn, even on every core.
    import torch

    from trainer_hooks.cpu_contention import warn_if_sharing_the_cpu
    from trainer_hooks.sglang_endpoints import SGLangEndpoints

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        assert warn_if_sharing_the_cpu(SGLangEndpoints([sglang_server_at_base.url], request_timeout_s=30)) is False
    finally:
        torch.set_num_threads(threads)


@pytest.mark.sglang
def test_trainer_talks_to_an_sglang_started_with_an_api_key(tiny_model_dir, tmp_path):
    import time as _time

    from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangRequestError

    server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        log_path=tmp_path / "server.log",
        extra_args=("--api-key", "s3cret"),
        die_with_parent=True,
    )
    server.start()
    try:
        server.wait_healthy(timeout_s=300)  # /health needs no key

        def generate_with(key):
            with contextlib.closing(SGLangEndpoints([server.url], request_timeout_s=120, api_key=key)) as endpoints:
                return endpoints.generate(
                    [[1, 2, 3]], {"max_new_tokens": 2, "n": 2}, want_logprobs=True, deadline=_time.monotonic() + 120
                )

        def sleeps_on_idle(key):
            with contextlib.closing(SGLangEndpoints([server.url], request_timeout_s=30, api_key=key)) as endpoints:
                return endpoints.sleeps_on_idle(server.url)

        [group] = generate_with("s3cret")
        assert len(group) == 2 and all(len(c.token_ids) == 2 for c in group)
        with pytest.raises(
            SGLangRequestError, match=r"HTTP 401: .*--api-key and the trainer sent none; set sglang_api_token"
        ):
            generate_with(None)
        with pytest.raises(SGLangRequestError, match="sent a different key"):
            generate_with("wrong")
        assert sleeps_on_idle("s3cret") is True and sleeps_on_idle(None) is None
    finally:
        server.stop()


def test_server_settings_are_the_config_fields_and_a_misspelt_one_is_refused(tmp_path):
    import dataclasses

    from rollout_service.sglang_launcher import SGLangServerConfig

    server = SGLangServer(
        tmp_path,
        device="cpu",
        port=31234,
        extra_args=["--dtype", "bfloat16"],
        python="",
        env=None,
        log_path=tmp_path / "s.log",
        die_with_parent=True,
    )
    config = server.config
    assert isinstance(config, SGLangServerConfig)
    assert (config.port, config.python, config.extra_args, config.env) == (
        31234,
        sys.executable,
        ("--dtype", "bfloat16"),
        {},
    )
    assert config.die_with_parent is True and server.url == "http://127.0.0.1:31234"
    assert set(f.name for f in dataclasses.fields(SGLangServerConfig)) >= {"model_path", "device", "lora"}
    with pytest.raises(TypeError, match="devcie"):
        SGLangServer(tmp_path, devcie="cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        SGLangServer(tmp_path, device="tpu")
