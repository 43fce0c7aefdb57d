"""The trainer config refuses, naming the field, the value and what is allowed, the settings that
used to pass and then fail later (a bare KeyError/TypeError/OverflowError, a blocked trainer); the
code behind them (log tails, checkpoint dtypes, /server_info) copes with what slips past."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollout_service.adapter_reader import LoraLimits
from rollout_service.cli import SHARD_MB
from rollout_service.cli_env import TIMEOUT_S
from rollout_service.protocol import ACK_EXPIRY_S, MIN_HEARTBEAT_MAX_AGE_S
from rollout_service.sidecar.settings import SidecarSettings
from trainer_helpers import make_config
from trainer_hooks.adapter_publish import server_lora_limits
from trainer_hooks.checkpoint_dtype import checkpoint_dtype, target_dtype
from trainer_hooks.config import NUMBER_RANGES, SHARD_MB_RANGE, SGLangRolloutArguments
from trainer_hooks.sglang_endpoints import LOG_TAIL_BYTES, SGLangEndpoints, _read_tail

URLS = ["http://127.0.0.1:1"]
SIDECARS = ["http://127.0.0.1:2"]


def config(tmp_path: Path, **overrides: Any) -> Any:
    return make_config(tmp_path, tmp_path, URLS, SIDECARS, **overrides)


# --- sglang_log_paths ------------------------------------------------------------------------


def test_a_log_path_that_is_a_fifo_or_a_device_is_refused_at_startup(tmp_path: Path) -> None:
    fifo = tmp_path / "sglang.log"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"sglang_log_paths entry '.*sglang\.log' is a FIFO, not a regular file"):
        config(tmp_path, sglang_log_paths=[str(fifo)])
    with pytest.raises(ValueError, match=r"sglang_log_paths entry '/dev/zero' is a device"):
        config(tmp_path, sglang_log_paths=["/dev/zero"])
    with pytest.raises(ValueError, match=r"sglang_log_paths entry '.*' is a directory"):
        config(tmp_path, sglang_log_paths=[str(tmp_path)])


def test_a_missing_log_file_a_regular_one_and_a_link_to_one_are_accepted(tmp_path: Path) -> None:
    real = tmp_path / "real.log"
    real.write_text("hello\n")
    link = tmp_path / "link.log"
    link.symlink_to(real)
    paths = [str(tmp_path / "later.log"), str(real), str(link)]
    cfg = make_config(
        tmp_path, tmp_path, [f"http://127.0.0.1:{p}" for p in (1, 3, 4)], SIDECARS, sglang_log_paths=paths
    )
    assert cfg.sglang_log_paths == paths


def test_reading_a_fifo_log_without_a_writer_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "sglang.log"
    os.mkfifo(fifo)
    endpoints = SGLangEndpoints(URLS, request_timeout_s=5, log_paths=[str(fifo)])
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(endpoints._error_lines(URLS[0])), daemon=True)
    reader.start()
    reader.join(10)
    blocked = reader.is_alive()
    if blocked:  # release the reader (a writer opening the FIFO ends its open) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    assert not blocked, "reading a FIFO with no writer blocked the trainer"
    assert found and "has no error lines" in found[0]


def test_reading_a_device_log_reads_nothing_and_a_big_file_only_its_tail(tmp_path: Path) -> None:
    # Run where memory is limited, so that an unbounded read of /dev/zero fails fast instead of eating the host.
    code = (
        "import os, resource\n"
        "from trainer_hooks.sglang_endpoints import _read_tail\n"
        "vm = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))\n"
        "print(len(_read_tail('/dev/zero')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]
    log = tmp_path / "big.log"
    lines = b"".join(b"line %d\n" % i for i in range(3 * LOG_TAIL_BYTES // 8))
    log.write_bytes(lines + b"RuntimeError: the end\n")
    tail = _read_tail(str(log))
    # The last LOG_TAIL_BYTES, less the line the window cuts (it could hide a credential's name).
    assert LOG_TAIL_BYTES - 20 < len(tail) <= LOG_TAIL_BYTES and tail.endswith("RuntimeError: the end\n")
    assert tail.startswith("line ")
    assert _read_tail(str(tmp_path / "missing.log")).startswith("(could not read")


# --- checkpoint_dtype ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "F64", "F8_E4M3", "int8", "float8_e4m3fn"])
def test_a_checkpoint_dtype_that_cannot_be_published_is_refused_naming_the_allowed_ones(
    tmp_path: Path, dtype: str
) -> None:
    with pytest.raises(ValueError, match=rf"checkpoint_dtype='{dtype}' .* use one of bfloat16, float16, float32"):
        config(tmp_path, checkpoint_dtype=dtype)


@pytest.mark.parametrize("dtype", ["bf16", "half", "torch.float32", "BF16", "float16"])
def test_every_spelling_of_a_publishable_dtype_is_accepted(tmp_path: Path, dtype: str) -> None:
    assert config(tmp_path, checkpoint_dtype=dtype).checkpoint_dtype == dtype
    assert target_dtype(dtype) in (torch.bfloat16, torch.float16, torch.float32)


def _model_in(dtype: torch.dtype) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2, dtype=dtype)
    model.config = SimpleNamespace(dtype=dtype)  # type: ignore[assignment]
    return model


def test_a_float64_model_needs_checkpoint_dtype_set() -> None:
    model = _model_in(torch.float64)
    with pytest.raises(ValueError, match=r"the model is in float64.*set checkpoint_dtype"):
        checkpoint_dtype(None, model)
    assert checkpoint_dtype("fp32", model) == "float32"
    with pytest.raises(ValueError, match=r"checkpoint_dtype='F8_E4M3'"):
        checkpoint_dtype("F8_E4M3", model)
    assert checkpoint_dtype(None, _model_in(torch.bfloat16)) == "bfloat16"


def test_a_model_cast_narrower_after_loading_publishes_in_the_dtype_it_holds() -> None:
    """transformers keeps the loaded dtype in the config across ``.to(dtype)``: a model loaded in
    float32 and cast to bfloat16 published float32 checkpoints, twice the bytes of the same values."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    assert model.config.dtype == torch.float32  # what made it go wrong
    assert checkpoint_dtype(None, model) == "bfloat16"
    # float32 masters of a bfloat16 model (mixed precision) keep the configured, served dtype.
    masters = Qwen2ForCausalLM(Qwen2Config(**{**config.to_dict(), "dtype": "bfloat16"})).to(torch.float32)
    assert checkpoint_dtype(None, masters) == "bfloat16"
    # Parameters in two dtypes (modules kept in float32) leave the configured one too.
    mixed = Qwen2ForCausalLM(config)
    mixed.model.layers.to(torch.bfloat16)
    assert checkpoint_dtype(None, mixed) == "float32"
    assert checkpoint_dtype("float32", model) == "float32"  # the setting still decides
    # Parameters in a dtype no checkpoint is published in (float8) leave the configured one.
    fp8 = Qwen2ForCausalLM(Qwen2Config(**{**config.to_dict(), "dtype": "bfloat16"})).to(torch.float8_e4m3fn)
    assert checkpoint_dtype(None, fp8) == "bfloat16"


# --- numbers: timeouts, shard size, delta ratio ------------------------------------------------


SECONDS_FIELDS = [name for name, (_, _, unit) in NUMBER_RANGES.items() if unit == "seconds"]


def test_every_seconds_field_shares_the_clis_timeout_range() -> None:
    described = {
        f.name
        for f in dataclasses.fields(SGLangRolloutArguments)
        if str(f.metadata.get("help", "")).lower().startswith("seconds")
    }
    assert described and described <= set(SECONDS_FIELDS)
    assert all(NUMBER_RANGES[name][:2] == TIMEOUT_S for name in SECONDS_FIELDS if name != HEARTBEAT)
    assert NUMBER_RANGES[HEARTBEAT][:2] == (MIN_HEARTBEAT_MAX_AGE_S, ACK_EXPIRY_S)


HEARTBEAT = "replica_heartbeat_max_age"
"""Seconds too, but from three of the sidecars' ack writes: a shorter age takes a live replica for
a dead one between two writes (retention then deletes the step it is loading)."""


@pytest.mark.parametrize("name", SECONDS_FIELDS)
@pytest.mark.parametrize("value", [1e12, 0.001, 0, -1.0, float("inf"), "600", True])
def test_a_timeout_outside_the_shared_range_is_refused_naming_it(tmp_path: Path, name: str, value: Any) -> None:
    low, high = ("15", "86400") if name == HEARTBEAT else ("0.01", "604800")
    with pytest.raises(ValueError, match=rf"{name} \(in seconds\) must be a finite number from {low} to {high}, got"):
        config(tmp_path, **{name: value})


@pytest.mark.parametrize("value", [0.5, 5.0, 14.9])
def test_a_heartbeat_age_a_live_replica_outlives_between_its_writes_is_refused(tmp_path: Path, value: float) -> None:
    assert 3 * SidecarSettings.__dataclass_fields__["ack_interval_s"].default == MIN_HEARTBEAT_MAX_AGE_S
    with pytest.raises(ValueError, match=rf"{HEARTBEAT} \(in seconds\) must be a finite number from 15 to"):
        config(tmp_path, **{HEARTBEAT: value})
    assert getattr(config(tmp_path, **{HEARTBEAT: 15.0}), HEARTBEAT) == 15.0


@pytest.mark.parametrize("name", SECONDS_FIELDS)
def test_the_longest_timeout_is_accepted(tmp_path: Path, name: str) -> None:
    longest = NUMBER_RANGES[name][1]
    assert getattr(config(tmp_path, **{name: longest}), name) == longest


def test_timeouts_are_checked_before_the_collective_budget_computes_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"sglang_request_timeout \(in seconds\) must be a finite number"):
        config(tmp_path, sglang_request_timeout="600")


@pytest.mark.parametrize("value", [1e-9, 0.0005, 1e302, float("nan"), "2048", True])
def test_a_shard_size_outside_what_publish_accepts_is_refused(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_max_shard_mb \(in MiB\) must be a finite number from 0.001 to"):
        config(tmp_path, checkpoint_max_shard_mb=value)


def test_the_shard_range_is_the_one_of_publish_max_shard_mb(tmp_path: Path) -> None:
    low, high = SHARD_MB_RANGE
    assert SHARD_MB(str(low)) == low and SHARD_MB(str(high)) == high
    for outside in (low / 2, high * 2):
        with pytest.raises(argparse.ArgumentTypeError):
            SHARD_MB(str(outside))
    assert config(tmp_path, checkpoint_max_shard_mb=low).checkpoint_max_shard_mb == low


@pytest.mark.parametrize("value", ["0.5", True, 0, 1.5, float("nan"), None])
def test_a_delta_ratio_that_is_not_a_fraction_is_refused_naming_it(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_delta_max_ratio must be a number in \(0, 1\]"):
        config(tmp_path, checkpoint_delta_max_ratio=value)


# --- switches --------------------------------------------------------------------------------


BOOL_FIELDS = {
    f.name: f.type != "bool" for f in dataclasses.fields(SGLangRolloutArguments) if f.type in ("bool", "bool | None")
}


def test_the_switches_are_found() -> None:
    assert BOOL_FIELDS == {"checkpoint_delta": True, "adapter_sync": False, "use_vllm": False}


@pytest.mark.parametrize("name", sorted(BOOL_FIELDS))
@pytest.mark.parametrize("value", ["false", "true", 0, 1, 1.0])
def test_a_switch_must_be_a_real_bool(tmp_path: Path, name: str, value: Any) -> None:
    allowed = "True, False or None \\(auto\\)" if BOOL_FIELDS[name] else "True or False"
    with pytest.raises(ValueError, match=rf"{name} must be {allowed}, got {value!r}"):
        config(tmp_path, **{name: value})


def test_real_bools_and_auto_are_accepted(tmp_path: Path) -> None:
    cfg = config(tmp_path, adapter_sync=False, checkpoint_delta=None)
    assert cfg.adapter_sync is False and cfg.checkpoint_delta is None
    assert config(tmp_path, checkpoint_delta=True).checkpoint_delta is True
    with pytest.raises(ValueError, match="adapter_sync must be True or False, got None"):
        config(tmp_path, adapter_sync=None)


# --- /server_info ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "info",
    [
        {"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": 5},
        {"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": {"q_proj": 1}},
        {"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": ["q_proj", 7]},
        {"enable_lora": True, "max_lora_rank": "64", "lora_target_modules": ["q_proj"]},
        {"enable_lora": True, "max_lora_rank": True, "lora_target_modules": ["q_proj"]},
        {"enable_lora": True, "max_lora_rank": 0, "lora_target_modules": ["q_proj"]},
        {"enable_lora": "false", "max_lora_rank": 64, "lora_target_modules": ["q_proj"]},
        {"enable_lora": None, "lora_paths": 5},
        ["enable_lora"],
    ],
)
def test_an_unreadable_server_info_is_a_value_error(info: Any) -> None:
    with pytest.raises(ValueError, match="/server_info"):
        LoraLimits.from_server_info(info)


def test_the_forms_sglang_sends_are_read() -> None:
    sent = {"enable_lora": None, "max_lora_rank": None, "lora_target_modules": None, "lora_paths": None}
    assert LoraLimits.from_server_info(sent) == LoraLimits(False, None)
    assert LoraLimits.from_server_info({}) == LoraLimits(False, None)
    paths = [{"lora_name": "a", "lora_path": "/a", "pinned": False}]
    limits = LoraLimits.from_server_info({"lora_paths": paths, "max_lora_rank": 8, "lora_target_modules": "all"})
    assert limits == LoraLimits(True, 8, frozenset({"all"}))


@pytest.fixture
def junk_server_info() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": 5}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_junk_server_info_falls_back_to_merged_sync_with_the_reason(junk_server_info: str) -> None:
    started = time.monotonic()
    [(url, limits)] = server_lora_limits([junk_server_info], None, timeout_s=10)
    assert url == junk_server_info and time.monotonic() - started < 10
    assert isinstance(limits, str)
    assert limits.startswith(f"cannot read {junk_server_info}/server_info (ValueError:")
    assert "lora_target_modules=5" in limits


# --- paths of any type and with ~ -----------------------------------------------------------


@pytest.mark.parametrize("value", [123, b"/tmp/ckpt", ["/tmp/ckpt"], "~no_such_user_zz91/ckpt"])
def test_a_checkpoint_path_that_is_no_usable_path_is_refused_naming_the_field(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_path") as refused:
        make_config(tmp_path, tmp_path, URLS, SIDECARS, checkpoint_path=value)
    assert "~" not in str(value) or "no home directory" in str(refused.value)


def test_a_log_path_given_as_a_path_object_or_with_tilde_is_read_like_a_string(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config(tmp_path, sglang_log_paths=tmp_path / "one.log")
    assert cfg.sglang_log_paths == [str(tmp_path / "one.log")]
    assert config(tmp_path, sglang_log_paths=["~/two.log"]).sglang_log_paths == [str(tmp_path / "two.log")]
    with pytest.raises(ValueError, match="sglang_log_paths must be a path or a list of paths"):
        config(tmp_path, sglang_log_paths=7)
    with pytest.raises(ValueError, match=r"sglang_log_paths entry .*no home directory"):
        config(tmp_path, sglang_log_paths=["~no_such_user_zz91/x.log"])


# --- settings that contradict each other ---------------------------------------------------------


def test_an_url_in_both_sglang_urls_and_sidecar_urls_is_named(tmp_path: Path, caplog) -> None:
    """The trainer then asked SGLang's /wait (a 404) until sync_timeout ran out, saying nothing."""
    with caplog.at_level(logging.WARNING, logger="trainer_hooks.config"):
        make_config(tmp_path, tmp_path, URLS, ["http://127.0.0.1:1/", *SIDECARS])
    assert "http://127.0.0.1:1 is in both sglang_urls and sidecar_urls" in caplog.text


def test_a_sidecar_token_without_sidecar_urls_is_named_as_unused(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_hooks.config"):
        make_config(tmp_path, tmp_path, URLS, None, expected_replicas=1, sidecar_token="t" * 16)
    assert "sidecar_token is set but unused" in caplog.text


def test_a_heartbeat_age_past_the_acks_expiry_is_refused(tmp_path: Path) -> None:
    """Acks older than a day are removed (and retention then no longer spares the replica's step),
    so a replica counted live for longer would lose its protection."""
    with pytest.raises(ValueError, match="replica_heartbeat_max_age"):
        config(tmp_path, replica_heartbeat_max_age=2 * 86400.0)
    assert config(tmp_path, replica_heartbeat_max_age=86400.0).replica_heartbeat_max_age == 86400.0
