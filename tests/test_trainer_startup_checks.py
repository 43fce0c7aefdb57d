"""The trainer's start-up checks: a clear error at construction instead of a failure mid-run."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from fake_sglang import dead_url
from trainer_helpers import make_config
from trainer_hooks.sglang_endpoints import SGLangEndpoints
from trainer_hooks.trainer import check_trl_version


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
    from trainer_hooks.cpu_contention import warn_if_sharing_the_cpu

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


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sync_timeout": float("inf")}, r"sync_timeout \(in seconds\) must be a finite number from 0.01 to 604800"),
        ({"sglang_request_timeout": float("nan")}, r"sglang_request_timeout \(in seconds\) must be a finite"),
        ({"checkpoint_max_shard_mb": float("inf")}, r"checkpoint_max_shard_mb \(in MiB\) must be a finite number from"),
        ({"keep_checkpoints": 2.0}, r"keep_checkpoints must be an integer >= 1 \(or None"),
        ({"max_staleness": True}, "max_staleness must be an integer >= 0, got True"),
        ({"sglang_urls": ["http://::1:30000"]}, r"IPv6 host in brackets \(http://\[::1\]:30000\)"),
        ({"sglang_urls": ["http://127.0.0.1:99999"]}, "port 99999, outside 1-65535"),
        ({"sidecar_urls": ["http://u:secret@127.0.0.1:8100"]}, "carries a user name or password"),
    ],
    ids=["inf-timeout", "nan-timeout", "inf-shard", "float-keep", "bool-staleness", "ipv6", "port", "password"],
)
def test_a_setting_that_would_fail_later_is_refused_at_startup_naming_it(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    settings = {"sglang_urls": ["http://127.0.0.1:1"], "sidecar_urls": ["http://127.0.0.1:2"], **overrides}
    urls, sidecars = settings.pop("sglang_urls"), settings.pop("sidecar_urls")
    with pytest.raises(ValueError, match=message) as failed:
        make_config(tmp_path, tmp_path, urls, sidecars, **settings)
    assert "secret" not in str(failed.value)


def test_expected_replicas_must_be_a_whole_number(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected_replicas must be an integer >= 1, got 1.5"):
        make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], [], expected_replicas=1.5)
    assert make_config(tmp_path, tmp_path, ["http://[::1]:1/"], [], expected_replicas=2).sglang_urls == [
        "http://[::1]:1"
    ]
