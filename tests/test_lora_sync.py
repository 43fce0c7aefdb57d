"""Adapter sync against a real SGLang LoRA server on the CPU: load, match PEFT, unload, reject, restart.

A module-scoped SGLang is started with ``--enable-lora`` (``LoraServing``: the ``torch_native``
backend, the CPU shim for pinned buffers) beside a real sidecar. A PEFT LoRA model is trained for
real (Adam on a causal-LM loss) and each version is published as an adapter step; SGLang's greedy
tokens and per-token logprobs with that adapter are compared with transformers + peft.
"""

from __future__ import annotations

import shutil
import sys
import time

import httpx
import pytest
import torch

from rollout_service.adapter_writer import publish_adapter
from rollout_service.lora_serving import LoraServing
from rollout_service.protocol import adapter_name_for
from rollout_service.sglang_launcher import SGLangServer
from rollout_service.tiny_model import make_tiny_model
from sidecar_helpers import Sidecar, assert_load_interval_inside_sync
from trainer_hooks.adapter_publish import adapter_sync_problem

PROMPTS = [[11, 42, 7, 99, 256, 3], [5, 17, 1200, 64, 9]]
NEW_TOKENS = 10
LOGPROB_ATOL = 2e-3
"""float32 on both sides; SGLang's torch_native LoRA adds x·A·B·(alpha/r) in another order than
peft, and its attention kernels differ from transformers': differences seen are ~1e-5."""
RUN_ID = "lora-test"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    """A real SGLang on the CPU serving LoRA adapters up to rank 16."""
    log = tmp_path_factory.mktemp("lora-sglang") / "server.log"
    server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        log_path=log,
        die_with_parent=True,
        lora=LoraServing(max_rank=16, max_loras_per_batch=4),
    )
    server.start()
    try:
        server.wait_healthy(300)
        yield server
    finally:
        server.stop()


@pytest.fixture
def lora_sidecar(lora_server, checkpoint_root, tmp_path):
    started = []

    def start(*extra: str, replica_id: str = "r0", url: str | None = None):
        sc = Sidecar(
            checkpoint_root,
            url or lora_server.url,
            tmp_path / f"sidecar-{len(started)}.log",
            *extra,
            replica_id=replica_id,
        )
        started.append(sc)
        return sc

    yield start
    for sc in started:
        sc.stop()


def peft_model(model_dir, targets=ALL_LINEAR, r=8):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))


def train_steps(model, steps: int, seed: int) -> None:
    """Real training: Adam on next-token loss over a fixed random batch (moves lora_A and lora_B)."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, 4000, (4, 24), generator=g)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def publish(model, root, step: int):
    """As the trainer publishes: with the digests of base tensors that tell its base model."""
    from peft import get_peft_model_state_dict

    from trainer_hooks.adapter_publish import base_values_of

    return publish_adapter(
        root,
        step,
        get_peft_model_state_dict(model),
        model.peft_config["default"].to_dict(),
        run_id=RUN_ID,
        base_values=base_values_of(model),
    )


def sglang_greedy(url: str, prompt: list[int], lora: str | None) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "return_logprob": True,
    }
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def peft_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [float(lps[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def peft_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def served_adapters(url: str) -> set[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout_s} s")


def test_adapter_versions_from_training_serve_what_peft_computes(
    lora_server, lora_sidecar, checkpoint_root, tiny_model_dir
):
    sidecar = lora_sidecar("--lora-keep", "2")
    model = peft_model(tiny_model_dir)
    base_tokens = [sglang_greedy(lora_server.url, p, None)[0] for p in PROMPTS]
    worst = 0.0
    for version in (1, 2, 3):
        train_steps(model, 3, seed=version)
        result = publish(model, checkpoint_root, version)
        assert result.kind == "adapter" and result.total_bytes < 200_000
        status = sidecar.wait_step(version)
        assert status["loaded_step"] == version and status["last_error"] is None, status
        name = adapter_name_for(version, RUN_ID)
        last = status["last_sync"]
        assert (last["step"], last["kind"], last["weight_version"]) == (version, "adapter", name), last
        assert last["validate_s"] >= 0 and last["load_s"] > 0
        assert_load_interval_inside_sync(last)
        assert sidecar.metric("rollout_sidecar_last_sync_kind", kind="adapter") == 1
        for prompt in PROMPTS:
            tokens, logprobs = sglang_greedy(lora_server.url, prompt, name)
            assert tokens == peft_greedy(model, prompt), f"version {version}: SGLang's greedy tokens differ from peft"
            want = peft_logprobs(model, prompt, tokens)
            diffs = [abs(a - b) for a, b in zip(logprobs, want)]
            worst = max(worst, *diffs)
            assert max(diffs) <= LOGPROB_ATOL, (version, logprobs, want)
        assert any(sglang_greedy(lora_server.url, p, name)[0] != b for p, b in zip(PROMPTS, base_tokens)), (
            "the trained adapter does not change any greedy output: the test proves nothing"
        )
    print(f"largest |logprob SGLang - peft| over 3 versions: {worst:.2e}")
    # --lora-keep 2: version 1 left the window once version 3 was loaded.
    wait_until(
        lambda: adapter_name_for(1, RUN_ID) not in served_adapters(lora_server.url), 30, "version 1 was not unloaded"
    )
    assert {adapter_name_for(v, RUN_ID) for v in (2, 3)} <= served_adapters(lora_server.url)
    r = httpx.post(
        f"{lora_server.url}/generate",
        timeout=60,
        json={
            "input_ids": PROMPTS[0],
            "lora_path": adapter_name_for(1, RUN_ID),
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert r.status_code != 200, "SGLang still serves the unloaded version 1"
    ack = sidecar.status()
    assert ack["loaded_step"] == 3 and ack["weight_version"] == "3"


def test_corrupt_adapter_is_rejected_and_the_last_good_one_keeps_serving(
    lora_server, lora_sidecar, checkpoint_root, tiny_model_dir, tmp_path
):
    sidecar = lora_sidecar()
    model = peft_model(tiny_model_dir, targets=["q_proj", "v_proj"])
    train_steps(model, 2, seed=7)
    publish(model, checkpoint_root, 1)
    sidecar.wait_step(1)
    good = sglang_greedy(lora_server.url, PROMPTS[0], adapter_name_for(1, RUN_ID))
    train_steps(model, 2, seed=8)
    path = publish(model, checkpoint_root, 2).path
    weights = path / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-8:] = b"\xff" * 8  # NaN bits in the last tensor, same size: only the digest can tell
    weights.write_bytes(bytes(raw))
    r = sidecar.get("/wait?version=2&timeout=60", timeout=90)
    assert r.status_code != 200
    status = sidecar.status()
    assert status["rejected"].get("2") == "digest_mismatch", status
    assert status["loaded_step"] == 1
    tokens, logprobs = sglang_greedy(lora_server.url, PROMPTS[0], adapter_name_for(1, RUN_ID))
    assert tokens == good[0] and max(abs(a - b) for a, b in zip(logprobs, good[1])) <= LOGPROB_ATOL
    # An adapter whose rank is above the server's --max-lora-rank 16 never reaches SGLang.
    big = peft_model(tiny_model_dir, targets=["q_proj", "v_proj"], r=32)
    publish(big, checkpoint_root, 3)
    wait_until(lambda: "3" in sidecar.status()["rejected"], 60, "the rank-32 adapter was not rejected")
    status = sidecar.status()
    assert status["rejected"]["3"] == "adapter_unservable" and "max-lora-rank 16" in status["last_error"]["message"]
    assert status["loaded_step"] == 1
    # An adapter trained on another base model of the same shapes would load and generate from
    # weights the trainer never had: its recorded base values tell, and it never reaches SGLang.
    other_base = make_tiny_model(tmp_path / "other-base", seed=1)
    publish(peft_model(other_base, targets=["q_proj", "v_proj"]), checkpoint_root, 4)
    wait_until(lambda: "4" in sidecar.status()["rejected"], 60, "the other base's adapter was not rejected")
    status = sidecar.status()
    assert status["rejected"]["4"] == "adapter_base_mismatch", status
    assert "trained on another base model" in status["last_error"]["message"]
    assert status["loaded_step"] == 1 and adapter_name_for(4, RUN_ID) not in served_adapters(lora_server.url)


def test_restarted_sglang_gets_the_newest_adapter_again(lora_server, lora_sidecar, checkpoint_root, tiny_model_dir):
    sidecar = lora_sidecar()
    model = peft_model(tiny_model_dir, targets=["q_proj", "v_proj"])
    for version in (1, 2):
        train_steps(model, 2, seed=20 + version)
        publish(model, checkpoint_root, version)
    sidecar.wait_step(2)
    before = sglang_greedy(lora_server.url, PROMPTS[1], adapter_name_for(2, RUN_ID))[0]
    lora_server.restart(300)
    wait_until(
        lambda: adapter_name_for(2, RUN_ID) in served_adapters(lora_server.url),
        120,
        "the sidecar did not load version 2 into the restarted SGLang",
    )
    status = sidecar.wait_step(2)
    assert status["loaded_step"] == 2
    assert sglang_greedy(lora_server.url, PROMPTS[1], adapter_name_for(2, RUN_ID))[0] == before
    assert sidecar.metric("rollout_sidecar_sglang_restarts_total") >= 1


def test_a_second_replica_catches_up_and_both_serve_each_new_adapter(
    lora_server, lora_sidecar, checkpoint_root, tiny_model_dir, tmp_path
):
    first = lora_sidecar(replica_id="r0")
    model = peft_model(tiny_model_dir, targets=["q_proj", "v_proj", "gate_proj"])
    for version in (1, 2):
        train_steps(model, 2, seed=40 + version)
        publish(model, checkpoint_root, version)
    first.wait_step(2)
    second_server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        die_with_parent=True,
        log_path=tmp_path / "second-sglang.log",
        lora=LoraServing(max_rank=16, max_loras_per_batch=4),
    )
    second_server.start()
    try:
        second_server.wait_healthy(300)
        second = lora_sidecar(replica_id="r1", url=second_server.url)
        assert second.wait_step(2)["loaded_step"] == 2  # the newest, not every version before it
        assert adapter_name_for(1, RUN_ID) not in served_adapters(second_server.url)
        train_steps(model, 2, seed=43)
        publish(model, checkpoint_root, 3)
        name = adapter_name_for(3, RUN_ID)
        for sidecar in (first, second):
            assert sidecar.wait_step(3)["loaded_step"] == 3
        for prompt in PROMPTS:
            a, b = (sglang_greedy(s.url, prompt, name) for s in (lora_server, second_server))
            assert a[0] == b[0] == peft_greedy(model, prompt)
            assert max(abs(x - y) for x, y in zip(a[1], b[1])) <= LOGPROB_ATOL
    finally:
        second_server.stop()


def test_an_adapter_waits_while_sglang_serves_a_full_checkpoint_and_loads_once_it_is_back_on_its_base(
    lora_server, lora_sidecar, checkpoint_root, tiny_model_dir
):
    """An adapter is trained against the base model: once a full checkpoint replaced SGLang's
    weights, it is not loaded (``adapter_base_replaced``, a failed sync, not a rejection: the
    step is sound), and it is loaded as soon as SGLang runs on its base again. Last in the module:
    it leaves the server restarted on its base model."""
    from sidecar_helpers import publish_step

    sidecar = lora_sidecar()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    assert sidecar.wait_step(1)["loaded_step"] == 1
    model = peft_model(tiny_model_dir, targets=["q_proj", "v_proj"])
    train_steps(model, 2, seed=60)
    from peft import get_peft_model_state_dict

    run = "base-swap"  # its own adapter names: earlier tests left theirs in the shared server
    publish_adapter(
        checkpoint_root, 2, get_peft_model_state_dict(model), model.peft_config["default"].to_dict(), run_id=run
    )
    wait_until(
        lambda: sidecar.metric("rollout_sidecar_syncs_total", outcome="failed", reason="adapter_base_replaced") >= 1,
        60,
        "the adapter was not refused while SGLang served a full checkpoint",
    )
    status = sidecar.status()
    assert status["last_error"]["reason"] == "adapter_base_replaced" and status["last_error"]["step"] == 2, status
    assert "2" not in status["rejected"] and status["loaded_step"] == 1
    assert adapter_name_for(2, run) not in served_adapters(lora_server.url)
    # A trainer starting now chooses merged syncs, saying why (each adapter sync would wait out
    # sync_timeout), and adapter sync again once SGLang runs on its base.
    problem = adapter_sync_problem(model, None, [lora_server.url], None)
    assert problem is not None and "serves the full checkpoint version 1" in problem, problem
    lora_server.restart(300)
    assert adapter_sync_problem(model, None, [lora_server.url], None) is None
    assert sidecar.wait_step(2, timeout_s=180)["loaded_step"] == 2
    for prompt in PROMPTS:
        assert sglang_greedy(lora_server.url, prompt, adapter_name_for(2, run))[0] == peft_greedy(model, prompt)


def test_a_base_model_folder_that_cannot_be_read_holds_the_adapter_back_without_rejecting_it(
    lora_server, lora_sidecar, checkpoint_root, tiny_model_dir, tmp_path
):
    """The served model's folder is the operator's, not the step's: while it cannot be read for
    the base check (here its weights file is no safetensors file any more) the adapter step waits,
    reported as ``base_model_unreadable``, and loads once the folder is repaired."""
    base_copy = tmp_path / "base-copy"
    shutil.copytree(tiny_model_dir, base_copy)
    sidecar = lora_sidecar("--reference-dir", str(base_copy))
    model = peft_model(tiny_model_dir, targets=["q_proj", "v_proj"])
    train_steps(model, 1, seed=41)
    publish(model, checkpoint_root, 1)
    sidecar.wait_step(1)
    weights = base_copy / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64)
    train_steps(model, 1, seed=42)
    publish(model, checkpoint_root, 2)
    wait_until(
        lambda: (sidecar.status().get("last_error") or {}).get("reason") == "base_model_unreadable",
        60,
        "the unreadable base folder was not reported",
    )
    status = sidecar.status()
    assert "2" not in status["rejected"] and status["loaded_step"] == 1, status
    assert str(base_copy) in status["last_error"]["message"] and status["last_error"]["step"] == 2
    weights.write_bytes(intact)
    sidecar.wait_step(2)
    assert adapter_name_for(2, RUN_ID) in served_adapters(lora_server.url)
