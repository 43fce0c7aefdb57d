"""TRL's GRPO trainer generating with SGLang and syncing weights through a checkpoint root.

The end-to-end tests run real TRL against real `rollout-service serve` units (SGLang + sidecar)
on the CPU with the tiny local models; one unit per model is shared by the tests of this module.
Failure modes (floats for token ids, stale or hung servers, dead sidecars) use a small in-process
fake that speaks SGLang's `/generate` and the sidecar's `/wait`, so they are fast and exact.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_service.sglang_launcher import kill_me_with_parent
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar.acks import write_ack
from trainer_hooks import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trainer_hooks.checkpoint_retention import prune_checkpoints
from trainer_hooks.checkpoint_sync import CheckpointPublisher
from trainer_hooks.replica_wait import AckFileWaiter, ReplicaSyncTimeout
from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangUnavailableError
from trainer_hooks.sglang_generation import StaleWeightsError
from trainer_hooks.sglang_responses import SGLangResponseError, parse_generate_response
from trainer_hooks.trainer import check_trl_version
from trainer_hooks.weight_gather import iter_full_weights

from helpers import free_port

UNIT_READY_TIMEOUT_S = 600.0
"""Two shared cores: SGLang may need minutes to start while other test jobs run."""
SLOW_SYNC_TIMEOUT_S = 180.0
LOGPROB_TOLERANCE = 0.05
"""Max |SGLang logprob - trainer logprob| per token; both run the float32 model (observed ~0.01)."""
VOCAB_SIZE = 4096


# --- a real rollout unit: `rollout-service serve` (SGLang + sidecar) ---------------------------------------

@dataclass
class RolloutUnit:
    """One `rollout-service serve` process: an SGLang server and the sidecar that keeps it synced."""

    model_dir: Path
    checkpoint_root: Path
    sglang_url: str
    sidecar_url: str
    process: subprocess.Popen
    log_path: Path


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout-service"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout_service.cli"]


def launch_unit(model_dir: Path, workdir: Path) -> RolloutUnit:
    """Start `rollout-service serve` in its own session; returns at once (see `_wait_ready`)."""
    root = workdir / "ckpts"
    root.mkdir(parents=True)
    sglang_port, sidecar_port = free_port(), free_port()
    log_path = workdir / "serve.log"
    cmd = _serve_command() + [
        "serve", "--model", str(model_dir), "--checkpoint-path", str(root), "--port", str(sglang_port),
        "--sidecar-port", str(sidecar_port), "--device", "cpu", "--sglang-log", str(workdir / "sglang.log"),
        "--replica-id", f"test-{sidecar_port}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=kill_me_with_parent)
    return RolloutUnit(model_dir, root, f"http://127.0.0.1:{sglang_port}", f"http://127.0.0.1:{sidecar_port}",
                       proc, log_path)


def _wait_ready(unit: RolloutUnit) -> None:
    deadline = time.monotonic() + UNIT_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if unit.process.poll() is not None:
            raise RuntimeError(f"rollout-service serve exited with {unit.process.returncode}:\n{_tail(unit.log_path)}")
        try:
            if httpx.get(f"{unit.sidecar_url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the rollout unit was not ready within {UNIT_READY_TIMEOUT_S:.0f} s:\n{_tail(unit.log_path)}")


def _stop_unit(proc: subprocess.Popen) -> None:
    """SIGTERM serve (it stops SGLang's own process group); SIGKILL what is left of its descendants."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # Belt and braces: whatever of serve's process tree outlived it (SGLang runs in its own group).
    alive = [child for child in descendants if child.is_running()]
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(alive, timeout=20)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def ready_unit(model_dir: Path, work_dir: Path) -> Iterator[RolloutUnit]:
    """A started and ready rollout unit (`serve`), stopped on exit: for module-scoped fixtures."""
    unit = launch_unit(model_dir, work_dir)
    try:
        _wait_ready(unit)
        yield unit
    finally:
        _stop_unit(unit.process)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@pytest.fixture(scope="module")
def rollout_units(tiny_model_dir: Path, tiny_model_dir_tied: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RolloutUnit]]:
    """Both units (untied and tied model), launched together so that their slow start-ups overlap."""
    units: dict[str, RolloutUnit] = {}
    try:
        units["untied"] = launch_unit(tiny_model_dir, tmp_path_factory.mktemp("unit-untied"))
        units["tied"] = launch_unit(tiny_model_dir_tied, tmp_path_factory.mktemp("unit-tied"))
        yield units
    finally:
        for unit in units.values():
            _stop_unit(unit.process)


@pytest.fixture(scope="module")
def untied_unit(rollout_units: dict[str, RolloutUnit]) -> RolloutUnit:
    _wait_ready(rollout_units["untied"])
    return rollout_units["untied"]


@pytest.fixture(scope="module")
def tied_unit(rollout_units: dict[str, RolloutUnit]) -> RolloutUnit:
    _wait_ready(rollout_units["tied"])
    return rollout_units["tied"]


# --- a fake SGLang server + sidecar in one HTTP server ------------------------------------------------------

@dataclass
class FakeRollout:
    """Speaks SGLang's POST /generate and the sidecar's GET /wait and POST /sync, with knobs.

    Completions start with their prompt's first token (so order can be checked) and report
    `weight_version` = the newest version a /wait confirmed, unless `fixed_version` is set.
    """

    float_token_ids: bool = False
    fixed_version: str | None = None
    stale_answers: int = 0
    abort_answers: int = 0
    generate_delay_s: float = 0.0
    wait_status: int = 200
    wait_body: dict[str, Any] = field(default_factory=dict)
    loaded: int = 0
    generate_requests: list[dict[str, Any]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeRollout":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path != "/wait":
                    return self._reply(404, {"detail": "not found"})
                version = int(parse_qs(url.query)["version"][0])
                if fake.wait_status == 200:
                    fake.loaded = max(fake.loaded, version)
                    return self._reply(200, {"loaded_step": fake.loaded, "sglang_healthy": True})
                time.sleep(min(0.2, float(parse_qs(url.query)["timeout"][0])))
                return self._reply(fake.wait_status, fake.wait_body)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/sync":
                    return self._reply(202, {"triggered": True})
                if self.path != "/generate":
                    return self._reply(404, {"detail": "not found"})
                fake.generate_requests.append(body)
                if fake.generate_delay_s:
                    time.sleep(fake.generate_delay_s)
                self._reply(200, fake.answer(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def answer(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        params = body["sampling_params"]
        n, length = int(params.get("n", 1)), min(int(params["max_new_tokens"]), 6)
        if self.fixed_version is not None:
            version = self.fixed_version
        elif self.stale_answers > 0:
            self.stale_answers -= 1
            version = "default"
        else:
            version = str(self.loaded)
        finish = "length"
        if self.abort_answers > 0:
            self.abort_answers -= 1
            finish = "abort"
        rng = random.Random(len(self.generate_requests))
        out = []
        for prompt in body["input_ids"]:
            for _ in range(n):
                ids = [prompt[0]] + [rng.randrange(10, VOCAB_SIZE) for _ in range(length - 1)]
                wire = [float(t) for t in ids] if self.float_token_ids else ids
                out.append({"output_ids": wire, "meta_info": {
                    "weight_version": version, "finish_reason": {"type": finish},
                    "output_token_logprobs": [[-8.0, t, None] for t in wire]}})
        return out

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeRollout]:
    server = FakeRollout().start()
    yield server
    server.stop()


def dead_url() -> str:
    """A URL nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


# --- trainer helpers ---------------------------------------------------------------------------------------

def prompts_dataset(count: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"write number {i}"}] for i in range(count)]})


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [len(c[0]["content"]) / 100.0 for c in completions]


def make_config(tmp_path: Path, root: Path, sglang_urls: list[str], sidecar_urls: list[str] | None = None,
                config_class: type = GRPOConfig, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), checkpoint_path=str(root), sglang_urls=sglang_urls,
        sidecar_urls=sidecar_urls or [], report_to="none", use_cpu=True, bf16=False, num_generations=4,
        per_device_train_batch_size=4, max_completion_length=8, max_steps=3, logging_steps=1,
        save_strategy="no", learning_rate=1e-3, sync_timeout=SLOW_SYNC_TIMEOUT_S, disable_tqdm=True, seed=0)
    settings.update(overrides)
    return config_class(**settings)


def make_trainer(model_dir: Path, config: Any, trainer_class: type = GRPOTrainer) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return trainer_class(model=model, reward_funcs=length_reward, args=config, train_dataset=prompts_dataset(),
                         processing_class=tokenizer)


class EmbeddingInputs:
    """Records the dtype of every tensor that reaches the model's input embedding."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.dtypes: list[torch.dtype] = []
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.dtypes.append(args[0].dtype)

    def close(self) -> None:
        self._handle.remove()


def logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# --- (e) start-up checks -------------------------------------------------------------------------------------

def test_missing_checkpoint_path_fails_at_startup_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_path .*missing-dir does not exist; create it or mount"):
        make_config(tmp_path, tmp_path / "missing-dir", ["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    with pytest.raises(ValueError, match="checkpoint_path is required"):
        make_config(tmp_path, "", ["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        make_config(tmp_path, a_file, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"])


def test_unwritable_checkpoint_path_fails_at_startup_with_a_clear_error(tmp_path: Path) -> None:
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root ignores permission bits: use a directory even root cannot write
        locked = Path("/sys/kernel")
    try:
        with pytest.raises(ValueError, match=r"checkpoint_path .* is not writable by this process"):
            make_config(tmp_path, locked, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    finally:
        (tmp_path / "read-only").chmod(0o755)



def test_sglang_api_token_is_redacted_in_the_logged_config(tmp_path: Path) -> None:
    config = make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], sglang_api_token="s3cret")
    assert config.sglang_api_token == "s3cret"
    assert config.to_dict()["sglang_api_token"] != "s3cret" and "s3cret" not in config.to_json_string()

def test_config_without_endpoints_or_a_way_to_wait_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no SGLang endpoint: set sglang_urls"):
        make_config(tmp_path, tmp_path, [], ["http://127.0.0.1:2"])
    with pytest.raises(ValueError, match="set sidecar_urls .* or expected_replicas"):
        make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], [])
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], vllm_mode="colocate")


def test_untested_trl_version_is_refused_with_a_clear_message() -> None:
    check_trl_version("1.16.3")
    with pytest.raises(RuntimeError, match=r"tested with TRL .*1\.17\.0 is installed"):
        check_trl_version("1.17.0")



def test_a_trainer_on_every_core_beside_a_local_cpu_sglang_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    from trainer_hooks.sglang_generation import warn_if_sharing_the_cpu

    def endpoints_at(url: str) -> SGLangEndpoints:
        return SGLangEndpoints([url], request_timeout_s=5)

    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(cores)
        with caplog.at_level(logging.WARNING):
            assert warn_if_sharing_the_cpu(endpoints_at("http://10.0.0.5:30000")) is False  # another machine
            # Local, and its settings cannot be read (nothing listens): the trainer warns.
            assert warn_if_sharing_the_cpu(endpoints_at(dead_url())) is (not torch.cuda.is_available())
        if not torch.cuda.is_available():
            assert "torch.set_num_threads(" in caplog.text
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert warn_if_sharing_the_cpu(endpoints_at(dead_url())) is False
    finally:
        torch.set_num_threads(threads)

# --- (b) token ids are integers ------------------------------------------------------------------------------

def test_integral_float_token_ids_are_coerced_and_others_rejected() -> None:
    item = {"output_ids": [5.0, 7.0], "meta_info": {"weight_version": "3",
                                                    "output_token_logprobs": [[-1.0, 5.0, None], [-2.0, 7, None]]}}
    [[completion]] = parse_generate_response([item], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)
    assert completion.token_ids == [5, 7] and all(type(t) is int for t in completion.token_ids)
    assert completion.weight_version == 3
    bad = copy.deepcopy(item)
    bad["output_ids"][1] = 7.5
    with pytest.raises(SGLangResponseError, match=r"output_ids\[1\]: expected an integer token id, found the non-integral"):
        parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True)
    bad["output_ids"][1] = "7"
    with pytest.raises(SGLangResponseError, match="expected an integer token id, found '7'"):
        parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True)
    bad["output_ids"][1] = VOCAB_SIZE
    with pytest.raises(SGLangResponseError, match="outside the model's vocabulary"):
        parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)



def test_well_formed_answers_take_the_fast_path_with_the_same_result_and_checks() -> None:
    # Exact ints (what SGLang sends) are read in one pass; NaN logprobs become None either way,
    # and a logprob entry for another token, a negative id or an id beyond the vocabulary still fails.
    item = {"output_ids": [5, 7, 9], "meta_info": {"weight_version": "4", "output_token_logprobs": [
        [-1.0, 5, None], [float("nan"), 7, None], [-0.5, 9, None]]}}
    import trainer_hooks.sglang_responses as responses

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the checked path ran for a well-formed answer")

    with pytest.MonkeyPatch.context() as patch:  # proves the one-pass path served it
        patch.setattr(responses, "coerce_token_id", refuse)
        patch.setattr(responses, "_checked_logprobs", refuse)
        [[fast]] = parse_generate_response([item], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)
    slow_item = copy.deepcopy(item)
    slow_item["meta_info"]["output_token_logprobs"][2][0] = -1  # an int logprob: the checked path
    [[slow]] = parse_generate_response([slow_item], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)
    assert fast.token_ids == slow.token_ids == [5, 7, 9]
    assert fast.logprobs == [-1.0, None, -0.5] and slow.logprobs == [-1.0, None, -1.0]
    for path, value, message in [(("meta_info", "output_token_logprobs", 1, 1), 8, r"\[1\] is for token 8, output_ids\[1\] is 7"),
                                 (("output_ids", 0), -3, "outside the model's vocabulary"),
                                 (("output_ids", 2), VOCAB_SIZE, r"output_ids\[2\]: token id .* outside")]:
        bad = copy.deepcopy(item)
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(SGLangResponseError, match=message):
            parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)

def test_grpo_trains_on_integer_token_tensors_when_the_server_sends_floats(
        tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    """Without coercion TRL would build float tensors from these ids and the embedding would crash."""
    fake.float_token_ids = True
    root = tmp_path / "ckpts"
    root.mkdir()
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, root, [fake.url], [fake.url], max_steps=2))
    inputs = EmbeddingInputs(trainer.model)
    try:
        trainer.train()
    finally:
        inputs.close()
    assert torch.tensor([5.0]).dtype.is_floating_point  # what TRL would have built from the wire values
    assert inputs.dtypes and all(d in (torch.int64, torch.int32) for d in inputs.dtypes), inputs.dtypes
    assert all(type(v) is int for record in trainer.vllm_generation.history for v in record.versions)


# --- (a) GRPO steps through the checkpoint root, with (b) and (c) checked along the way ------------------------

def test_grpo_steps_sync_through_checkpoint_path_with_increasing_versions(
        untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [untied_unit.sidecar_url],
                         keep_checkpoints=2)
    trainer = make_trainer(untied_unit.model_dir, config)
    inputs = EmbeddingInputs(trainer.model)
    try:
        trainer.train()
    finally:
        inputs.close()
    history = list(trainer.vllm_generation.history)
    assert len(history) == 3
    published = [record.published_version for record in history]
    assert published == sorted(set(published)), published  # one new version per step
    for record in history:  # every completion came from the version published for its step
        assert set(record.versions) == {record.published_version}, record
    assert inputs.dtypes and all(d == torch.int64 for d in inputs.dtypes)
    # TRL's own importance-sampling diagnostics: SGLang's logprobs agree with the trainer's.
    assert logged(trainer, "sampling/sampling_logp_difference/max")
    assert max(logged(trainer, "sampling/sampling_logp_difference/max")) < LOGPROB_TOLERANCE
    # Sync metrics reach the trainer's logs.
    assert logged(trainer, "sglang/sync_version") == [float(v) for v in published]
    assert all(v >= 0 for v in logged(trainer, "sglang/sync_wait_s"))
    assert logged(trainer, "sglang/version_lag") == [0.0, 0.0, 0.0]
    # Retention: the newest two versions are left.
    assert [c.step for c in list_checkpoints(untied_unit.checkpoint_root)] == published[-2:]


def test_background_sync_keeps_rollouts_within_max_staleness(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [untied_unit.sidecar_url],
                         max_staleness=1)
    trainer = make_trainer(untied_unit.model_dir, config)
    trainer.train()  # returns after the last background sync finished (or raises its error)
    generation = trainer.vllm_generation
    assert generation.publisher is not None and not generation.publisher.busy
    assert generation.publisher.confirmed_version == generation.publisher.latest_version
    history = list(generation.history)
    assert len(history) == 3
    first = history[0].published_version
    for record in history:
        assert record.required_version == max(record.published_version - 1, first)
        assert all(v is not None and v >= record.required_version for v in record.versions), record
    assert max(logged(trainer, "sglang/version_lag")) <= 1



def test_trl_tool_loop_runs_multi_turn_through_sglang(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    # TRL's own tool-calling loop: SGLang writes a tool call (forced by SGLang's regex-constrained
    # decoding, passed through generation_kwargs: a random tiny model would not write one), TRL runs
    # the tool, appends its result and asks the backend again for the next turn.
    import re

    import trl

    calls: list[tuple[int, int]] = []

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        calls.append((a, b))
        return a + b

    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    config = make_config(tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [untied_unit.sidecar_url],
                         max_steps=1, max_completion_length=160, max_tool_calling_iterations=1,
                         generation_kwargs={"regex": re.escape(tool_call)})
    tokenizer = AutoTokenizer.from_pretrained(untied_unit.model_dir)
    # A chat template TRL knows how to parse tool calls from.
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    seen: list[Any] = []

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(untied_unit.model_dir, dtype=torch.float32),
                          reward_funcs=reward, args=config, train_dataset=prompts_dataset(), processing_class=tokenizer,
                          tools=[add])
    trainer.train()
    assert calls == [(1, 2)] * 4  # one call per completion
    assert logged(trainer, "tools/call_frequency") == [1.0] and logged(trainer, "tools/failure_frequency") == [0.0]
    for turns in seen:  # call, the tool's answer, then the next turn generated after it
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"], turns
        assert turns[1]["content"] == "3" and turns[2]["tool_calls"][0]["function"]["name"] == "add"
    # Both turns came from SGLang, on the weights published for the step.
    first, second = trainer.vllm_generation.history
    assert first.published_version == second.published_version is not None
    assert set(first.versions) == set(second.versions) == {first.published_version} and len(second.versions) == 4


def test_evaluation_generates_through_sglang_on_the_synced_weights(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [untied_unit.sidecar_url],
                         max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    model = AutoModelForCausalLM.from_pretrained(untied_unit.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=config, train_dataset=prompts_dataset(),
                          eval_dataset=prompts_dataset(4), processing_class=AutoTokenizer.from_pretrained(
                              untied_unit.model_dir))
    trainer.train()
    assert logged(trainer, "eval_reward"), trainer.state.log_history
    train_records, eval_records = list(trainer.vllm_generation.history)[:2], list(trainer.vllm_generation.history)[2:]
    assert len(train_records) == 2 and eval_records
    # Evaluation after step 2 saw step 2's update: a newer version than the last training rollout.
    for record in eval_records:
        assert record.published_version > train_records[-1].published_version
        assert set(record.versions) == {record.published_version}, record
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_loss" in metrics

def test_grpo_waits_through_ack_files_with_expected_replicas(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    config = make_config(tmp_path, untied_unit.checkpoint_root, [untied_unit.sglang_url], [], expected_replicas=1,
                         max_steps=1)
    trainer = make_trainer(untied_unit.model_dir, config)
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert set(record.versions) == {record.published_version}


def test_ack_file_timeout_names_lagging_and_dead_replicas(tmp_path: Path) -> None:
    write_ack(tmp_path, "alive", {"loaded_step": 3, "loading_step": 4})
    write_ack(tmp_path, "gone", {"loaded_step": 3})
    gone = tmp_path / "acks" / "gone.json"
    gone.write_text(json.dumps({**json.loads(gone.read_text()), "heartbeat": time.time() - 600}))
    waiter = AckFileWaiter(tmp_path, expected=2, max_age_s=60)
    with pytest.raises(ReplicaSyncTimeout, match=r"only 0 of expected_replicas=2 replica\(s\) acknowledged checkpoint "
                                                r"step-00000004 within sync_timeout=1 s\. Live replicas: 1\. Lagging: "
                                                r"alive \(loaded 3, loading 4\)\. Replicas without a fresh heartbeat "
                                                r"\(dead\?\): gone \(last heartbeat 60\d s ago\)"):
        waiter.wait(4, timeout_s=1)


# --- (c) SGLang's logprobs match the trainer's after a sync ----------------------------------------------------

def _trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _check_logprobs_match_after_sync(unit: RolloutUnit, tmp_path: Path) -> None:
    temperature = 0.7
    config = make_config(tmp_path, unit.checkpoint_root, [unit.sglang_url], [unit.sidecar_url],
                         temperature=temperature, max_completion_length=12)
    trainer = make_trainer(unit.model_dir, config)
    model = trainer.model
    # Not a deepcopy: the trainer binds an instance-level forward that a copy would still call.
    base = AutoModelForCausalLM.from_pretrained(unit.model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # weights SGLang has never seen: only a sync can make them agree
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.eval()
    generation = trainer.vllm_generation
    generation.sync_weights()
    tokenizer = trainer.processing_class
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for text in ("def main():", "import os")]
    n = 2
    _, completion_ids, logprobs, _ = generation.generate(
        prompts=[p for p in prompts for _ in range(n)], images=None, num_generations=n)
    assert set(generation.history[-1].versions) == {generation.publisher.latest_version}
    worst, worst_base = 0.0, 0.0
    for i, completion in enumerate(completion_ids):
        assert completion and all(type(t) is int for t in completion)
        served = torch.tensor([lp[0] for lp in logprobs[i]])
        mine = _trainer_logprobs(model, prompts[i // n], completion, temperature)
        before = _trainer_logprobs(base, prompts[i // n], completion, temperature)
        worst = max(worst, (served - mine).abs().max().item())
        worst_base = max(worst_base, (served - before).abs().max().item())
    assert worst < LOGPROB_TOLERANCE, f"SGLang and trainer logprobs differ by up to {worst:.4f}"
    assert worst_base > 10 * LOGPROB_TOLERANCE, "SGLang still serves the base weights: the sync changed nothing"


def test_sglang_logprobs_match_trainer_after_sync_untied(untied_unit: RolloutUnit, tmp_path: Path) -> None:
    _check_logprobs_match_after_sync(untied_unit, tmp_path)


def test_sglang_logprobs_match_trainer_after_sync_tied(tied_unit: RolloutUnit, tmp_path: Path) -> None:
    _check_logprobs_match_after_sync(tied_unit, tmp_path)


# --- (d) failures end in clear errors, never hangs -------------------------------------------------------------

def test_dead_sidecar_fails_the_sync_after_sync_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    sidecar = dead_url()
    config = make_config(tmp_path, tmp_path, [dead_url()], [sidecar], sync_timeout=3)
    trainer = make_trainer(tiny_model_dir, config)
    started = time.monotonic()
    with pytest.raises(ReplicaSyncTimeout, match=rf"did not load checkpoint step-00000001 within sync_timeout=3 s: "
                                                rf"{sidecar} \(unreachable: ConnectError"):
        trainer.train()
    assert time.monotonic() - started < 30


def test_sidecar_reporting_sglang_down_is_named_in_the_timeout_error(
        tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.wait_status = 504
    fake.wait_body = {"loaded_step": None, "sglang_healthy": False, "rejected": {},
                      "last_error": {"reason": "sglang_down", "message": "SGLang at http://x is not answering"}}
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=2))
    with pytest.raises(ReplicaSyncTimeout, match=r"\(loaded nothing, SGLang not healthy, last error: sglang_down: "
                                                r"SGLang at http://x is not answering\)"):
        trainer.train()


def test_rejected_checkpoint_fails_at_once(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.wait_status = 504
    fake.wait_body = {"loaded_step": None, "rejected": {"1": "shape_mismatch"},
                      "last_error": {"reason": "shape_mismatch", "message": "tensor x has shape [2]"}}
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=60))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rejected checkpoint step-00000001 \(shape_mismatch\)"):
        trainer.train()
    assert time.monotonic() - started < 30


def test_dead_sglang_fails_generation_after_sync_timeout(tiny_model_dir: Path, tmp_path: Path,
                                                         fake: FakeRollout) -> None:
    server = dead_url()
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [server], [fake.url], sync_timeout=3))
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match=rf"no SGLang endpoint answered .*{server}: ConnectError"):
        trainer.train()
    assert 3 <= time.monotonic() - started < 30


def test_hung_sglang_times_out_instead_of_hanging(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.generate_delay_s = 20
    config = make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=2, sglang_request_timeout=1)
    trainer = make_trainer(tiny_model_dir, config)
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match="no answer within the timeout"):
        trainer.train()
    assert time.monotonic() - started < 20


def test_stale_answers_are_retried_until_the_replica_catches_up(tiny_model_dir: Path, tmp_path: Path,
                                                               fake: FakeRollout) -> None:
    fake.stale_answers = 1
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=1))
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert record.stale_retries == 1 and set(record.versions) == {record.published_version}


def test_aborted_answers_are_generated_again(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.abort_answers = 1
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=1))
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert record.stale_retries == 1 and len(fake.generate_requests) == 2


def test_stale_answers_fail_after_sync_timeout(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    fake.fixed_version = "default"
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=3))
    with pytest.raises(StaleWeightsError, match=r"weights of version\(s\) \['default'\], but the trainer published version 1 "
                                               r"and max_staleness=0 requires version >= 1"):
        trainer.train()


# --- several endpoints ---------------------------------------------------------------------------------------

def test_batch_is_split_across_endpoints_in_prompt_order(fake: FakeRollout) -> None:
    other = FakeRollout().start()
    try:
        endpoints = SGLangEndpoints([fake.url, other.url], request_timeout_s=10, vocab_size=VOCAB_SIZE)
        groups = endpoints.generate([[11, 1], [22, 2], [33, 3]], {"n": 2, "max_new_tokens": 3},
                                    want_logprobs=True, deadline=time.monotonic() + 10)
        endpoints.close()
    finally:
        other.stop()
    assert [[c.token_ids[0] for c in group] for group in groups] == [[11, 11], [22, 22], [33, 33]]
    assert [len(r["input_ids"]) for r in fake.generate_requests] == [2]
    assert [len(r["input_ids"]) for r in other.generate_requests] == [1]


def test_dead_endpoint_is_skipped_while_another_answers(fake: FakeRollout, caplog: pytest.LogCaptureFixture) -> None:
    dead = dead_url()
    endpoints = SGLangEndpoints([dead, fake.url], request_timeout_s=10)
    with caplog.at_level(logging.WARNING):
        groups = endpoints.generate([[1, 2], [3, 4]], {"n": 1, "max_new_tokens": 2}, want_logprobs=False,
                                    deadline=time.monotonic() + 10)
    endpoints.close()
    assert [g[0].token_ids[0] for g in groups] == [1, 3]
    assert any(dead in r.getMessage() and "other endpoint(s) take its prompts" in r.getMessage()
               for r in caplog.records)


def test_all_endpoints_dead_raises_naming_each_after_the_deadline() -> None:
    dead_a, dead_b = dead_url(), dead_url()
    endpoints = SGLangEndpoints([dead_a, dead_b], request_timeout_s=5)
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError) as info:
        endpoints.generate([[1, 2]], {"n": 1, "max_new_tokens": 2}, want_logprobs=False,
                           deadline=time.monotonic() + 2)
    endpoints.close()
    assert dead_a in str(info.value) and dead_b in str(info.value)
    assert 2 <= time.monotonic() - started < 15


# --- retention, PEFT, RLOO ------------------------------------------------------------------------------------

class _NoWaiter:
    def notify(self, version: int) -> None:
        pass

    def wait(self, version: int, timeout_s: float) -> list[Any]:
        return []

    def protected_versions(self) -> set[int]:
        return set()


def test_retention_keeps_the_newest_and_what_a_live_replica_serves(tmp_path: Path) -> None:
    write_ack(tmp_path, "live", {"loaded_step": 1, "loading_step": None})
    write_ack(tmp_path, "dead", {"loaded_step": 2, "loading_step": None})
    dead_ack = tmp_path / "acks" / "dead.json"
    dead_ack.write_text(json.dumps({**json.loads(dead_ack.read_text()), "heartbeat": time.time() - 3600}))
    publisher = CheckpointPublisher(tmp_path, _NoWaiter(), config={"model_type": "x"}, dtype=None,
                                    max_shard_bytes=1 << 20, keep=2, sync_timeout_s=5, heartbeat_max_age_s=60)
    for _ in range(5):
        version = publisher.next_version()
        publisher.publish_and_wait(version, [("w", torch.full((4,), float(version)))])
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 4, 5]
    assert prune_checkpoints(tmp_path, keep=1, protected={4}) == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_versions_continue_above_checkpoints_already_in_the_root(tmp_path: Path) -> None:
    publish_checkpoint(tmp_path, 41, [("w", torch.zeros(2))], config={"model_type": "x"})
    publisher = CheckpointPublisher(tmp_path, _NoWaiter(), config={"model_type": "x"}, dtype=None,
                                    max_shard_bytes=1 << 20, keep=None, sync_timeout_s=5, heartbeat_max_age_s=60)
    assert publisher.next_version() == 42


def test_peft_weights_are_published_merged_under_base_names(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [name for name, _ in base.named_parameters()]
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        before = peft_model(ids).logits
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    published = {name: t.clone() for name, t in iter_full_weights(peft_model)}
    assert list(published) == names
    for name in names:
        torch.testing.assert_close(published[name], expected[name])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(published[q], base.state_dict()[q])  # the adapter really was merged
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, before)  # ...and unmerged afterwards


def test_rloo_trainer_generates_through_the_same_backend(tiny_model_dir: Path, tmp_path: Path,
                                                         fake: FakeRollout) -> None:
    config = make_config(tmp_path, tmp_path, [fake.url], [fake.url], config_class=RLOOConfig, max_steps=1)
    trainer = make_trainer(tiny_model_dir, config, trainer_class=RLOOTrainer)
    trainer.train()
    [record] = trainer.vllm_generation.history
    assert set(record.versions) == {1}
    assert fake.generate_requests[0]["return_logprob"] is False
