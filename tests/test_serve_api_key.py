"""`serve` is given SGLang's API key once: it starts SGLang with the sidecar's key, or gives the
sidecar the key passed to SGLang after `--`, and refuses two different keys before starting
anything. Before, SGLang ran without a key unless it was also given after `--`, and a key given
only after `--` left the sidecar's weight updates refused with 401.

The wiring is checked here without starting SGLang (`run_serve` is replaced by a recorder); the
real server started this way refuses an unkeyed weight update and loads the sidecar's:
tests/test_serve_and_replicas.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_service import cli
from rollout_service.cli import _one_sglang_api_key, main


@pytest.mark.parametrize(
    "passthrough, sidecar_key, want_args, want_key",
    [
        ([], "k1", ["--api-key", "k1"], "k1"),
        (["--tp-size", "2"], "k1", ["--tp-size", "2", "--api-key", "k1"], "k1"),
        (["--api-key", "k2"], None, ["--api-key", "k2"], "k2"),
        (["--api-key=k2"], None, ["--api-key=k2"], "k2"),
        (["--api-key", "k1"], "k1", ["--api-key", "k1"], "k1"),
        ([], None, [], None),
    ],
    ids=["sidecar-key", "sidecar-key-after-other-flags", "sglang-key", "sglang-key-equals", "same-key", "no-key"],
)
def test_one_key_for_sglang_and_sidecar(passthrough, sidecar_key, want_args, want_key):
    assert _one_sglang_api_key(passthrough, sidecar_key) == (want_args, want_key)


@pytest.mark.parametrize("passthrough", [["--api-key", "other-secret"], ["--api-key=other-secret"]])
def test_two_different_keys_are_refused_without_showing_either(passthrough):
    with pytest.raises(ValueError, match="differ") as caught:
        _one_sglang_api_key(passthrough, "sidecar-secret")
    assert "secret" not in str(caught.value)


def _serve(monkeypatch, tmp_path: Path, *argv: str, env: dict[str, str] | None = None):
    seen = {}

    def recorder(server, settings, policy, listeners):
        for sock in listeners:
            sock.close()
        seen["command"], seen["key"] = server.command(), settings.sglang_api_key
        return 0

    monkeypatch.setattr(cli, "run_serve", recorder)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    rc = main(["serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path / "root"), *argv])
    return rc, seen


def test_serve_starts_sglang_with_the_sidecars_key(monkeypatch, tmp_path):
    rc, seen = _serve(monkeypatch, tmp_path, env={"ROLLOUT_SGLANG_API_KEY": "from-env"})
    assert rc == 0
    command = seen["command"]
    assert command[command.index("--api-key") + 1] == "from-env" and seen["key"] == "from-env"


def test_serve_gives_the_sidecar_the_key_given_to_sglang(monkeypatch, tmp_path):
    rc, seen = _serve(monkeypatch, tmp_path, "--", "--api-key", "after-dashes")
    assert rc == 0
    assert seen["command"].count("--api-key") == 1 and seen["key"] == "after-dashes"


def test_serve_refuses_two_keys_before_starting_anything(monkeypatch, tmp_path, capsys):
    rc, seen = _serve(monkeypatch, tmp_path, "--sglang-api-key", "first-secret", "--", "--api-key", "second-secret")
    err = capsys.readouterr().err
    assert rc == 2 and not seen
    assert "differ" in err and "secret" not in err
