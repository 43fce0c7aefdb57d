"""Names from the untrusted checkpoint root never reach a message, a log line or the CLI's output raw.

A file under the root named ``x\\n2030-01-01 00:00:00,000 INFO ...: loaded step 99 ...\\x1b[2K``
made ``rollout-service validate`` print ``INVALID (unlisted_file): step-00000001/x`` and then a
separate, convincing forged log line, and the ESC sequence reached the terminal. Every
``CheckpointError``, every log record the commands' handler formats and every line
``validate``/``materialize`` print now shows control characters as escapes (``\\n``, ``\\x1b``,
``\\u2028``), while ordinary text, non-ASCII names too, shows as it is. Real checkpoints, the real
CLI (in this process and as a process of its own) and uvicorn with the sidecar's config.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout_service import cli
from rollout_service.checkpoint_format import CheckpointError
from rollout_service.checkpoint_writer import publish_checkpoint

REPO = Path(__file__).resolve().parents[1]
FORGED = "\n2030-01-01 00:00:00,000 INFO rollout_service.sidecar.controller: loaded step 99 (full) into SGLang\x1b[2K"
"""A forged log line, as a root writer would put it in a name."""
FORGED_SHOWN = (
    r"\n2030-01-01 00:00:00,000 INFO rollout_service.sidecar.controller: loaded step 99 (full) into SGLang\x1b[2K"
)
FORGED_LOGGED = (
    "\n    | 2030-01-01 00:00:00,000 INFO rollout_service.sidecar.controller: loaded step 99 (full) into SGLang"
    r"\x1b[2K"
)
"""How a log line shows it: a continuation line, indented, that no reader takes for a record."""
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""What no shown line may hold (this file's own list, not the module's)."""


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """``cli.main`` configures the root logger when it has no handler: undo that after each test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def _publish(root: Path, step: int = 1) -> Path:
    g = torch.Generator().manual_seed(step)
    state = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
    }
    return publish_checkpoint(root, step, state.items(), config={"model_type": "qwen2"}).path


# ------------------------------------------------------------------------------ CheckpointError


def test_a_checkpoint_error_shows_control_characters_as_escapes() -> None:
    message = "a\nb\rc\td\x1b[2Ke\x00f\x7fg\x85h\x9bi\u2028j\u2029k\u202el\u2066m"
    error = CheckpointError("bad_manifest", message)
    assert str(error) == r"a\nb\rc\td\x1b[2Ke\x00f\x7fg\x85h\x9bi\u2028j\u2029k\u202el\u2066m"
    assert not CONTROLS.search(str(error)) and error.reason == "bad_manifest"
    forged = str(CheckpointError("unlisted_file", f"step-00000001/x{FORGED}.safetensors is not in the manifest"))
    assert forged == f"step-00000001/x{FORGED_SHOWN}.safetensors is not in the manifest"


def test_ordinary_text_and_non_ascii_names_are_shown_as_they_are() -> None:
    from rollout_service.shown_values import escape_controls, shown_text

    text = "step-00000001/模型.safetensors, é, ü, Ωmega, 'quoted' \"double\" back\\slash, tabs are not"
    assert str(CheckpointError("unlisted_file", text)) == text
    assert escape_controls(text) == text and shown_text(text, 1000) == text
    assert escape_controls("\udcff\udcfe.safetensors") == r"\udcff\udcfe.safetensors"  # a name not UTF-8


# ------------------------------------------------------------------------------ validate and materialize


def test_validate_shows_an_unlisted_file_named_like_a_log_line_on_one_line(tmp_path: Path, capsys) -> None:
    step = _publish(tmp_path)
    (step / f"x{FORGED}.safetensors").touch()
    assert cli.main(["validate", str(step)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith(f"INVALID (unlisted_file): step-00000001/x{FORGED_SHOWN}.safetensors is not in the manifest")
    assert not CONTROLS.search(err[:-1]), repr(err)


def test_validate_shows_a_non_ascii_unlisted_file_name_as_it_is(tmp_path: Path, capsys) -> None:
    step = _publish(tmp_path)
    (step / "模型.safetensors").touch()
    assert cli.main(["validate", str(step)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("INVALID (unlisted_file): step-00000001/模型.safetensors is not in the manifest"), err


def test_materialize_shows_a_listed_file_named_like_a_log_line_on_one_line(tmp_path: Path, capsys) -> None:
    import json

    root = tmp_path / "root"
    step = _publish(root)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][f"mo{FORGED}.safetensors"] = manifest["files"].pop("model.safetensors")
    (step / "model.safetensors").unlink()
    (step / "manifest.json").unlink()
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["materialize", str(root), "--step", "1", "--out", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.splitlines()
    # refused for its name now (it was missing_file, the raw name quoted, before the name check)
    assert lines[-1].startswith(f"error: cannot materialize step-00000001 under {root} (bad_manifest): "), lines
    assert f"mo{FORGED_SHOWN}.safetensors" in lines[-1], lines
    assert not [line for line in lines if CONTROLS.search(line) or line.startswith("2030")], lines


# ------------------------------------------------------------------------------ log lines


def _record(*args: object, exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord(
        "rollout_service.sidecar.controller", logging.WARNING, __file__, 1, "rejected %s: %s", args, exc_info
    )


def test_the_cli_log_formatter_keeps_a_record_on_one_line_and_a_traceback_on_many() -> None:
    formatter = cli.log_formatter()
    record = _record(f"step-00000001/x{FORGED}.safetensors", "é 模型")
    line = formatter.format(record)
    first, *more = line.split("\n")
    assert more and all(m.startswith("    | ") for m in more), repr(line)  # no line passes for a record
    assert not CONTROLS.search(line.replace("\n", "")), repr(line)
    assert line.endswith(
        f" WARNING rollout_service.sidecar.controller: rejected step-00000001/x{FORGED_LOGGED}.safetensors: é 模型"
    )
    assert record.getMessage().startswith("rejected step-00000001/x\n2030"), "the record itself is left as it was"

    try:
        raise RuntimeError("the pass failed")
    except RuntimeError:
        exc_info = sys.exc_info()
    lines = formatter.format(_record(f"a{FORGED}", "\u2028b", exc_info=exc_info)).split("\n")
    assert "\n".join(lines[:2]).endswith(f"rejected a{FORGED_LOGGED}: \\u2028b"), lines
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "RuntimeError: the pass failed", lines
    assert not [line for line in lines if CONTROLS.search(line)], lines


def test_the_commands_and_the_sidecars_loggers_log_through_the_escaping_handler(tmp_path: Path) -> None:
    """The installed command (rollout_demo.cli), as a process of its own: its validate line, then
    a record of the sidecar's controller logger before and after uvicorn configures its own
    loggers (as ``sidecar``/``serve`` do), each one line."""
    step = _publish(tmp_path / "root")
    (step / f"x{FORGED}.safetensors").touch()
    script = textwrap.dedent(
        """
        import logging, sys
        from rollout_demo.cli import main
        from rollout_service.sidecar.app import create_app, uvicorn_config
        from rollout_service.sidecar.settings import SidecarSettings

        step, name = sys.argv[1], sys.argv[2]
        print("exit", main(["validate", step]), flush=True)
        log = logging.getLogger("rollout_service.sidecar.controller")
        log.warning("rejected %s", name)
        settings = SidecarSettings(
            checkpoint_path=step + "/..", sglang_url="http://127.0.0.1:1", replica_id="r", stage=False
        )
        uvicorn_config(create_app(settings), settings)
        log.warning("after uvicorn's config: rejected %s", name)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script, str(step), f"x{FORGED}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 0 and done.stdout == "exit 1\n", (done.stdout, done.stderr)
    lines = done.stderr.split("\n")
    assert len(lines) == 6 and lines[-1] == "", lines
    assert lines[0].startswith(f"INVALID (unlisted_file): step-00000001/x{FORGED_SHOWN}.safetensors"), lines
    assert "\n".join(lines[1:3]).endswith(f" WARNING rollout_service.sidecar.controller: rejected x{FORGED_LOGGED}"), (
        lines
    )
    assert "\n".join(lines[3:5]).endswith(
        f" WARNING rollout_service.sidecar.controller: after uvicorn's config: rejected x{FORGED_LOGGED}"
    )
    assert not [line for line in lines if CONTROLS.search(line)], lines


def test_uvicorns_access_log_shows_no_control_character_of_a_request_path(tmp_path: Path) -> None:
    """What uvicorn already does (the threat model relies on it): h11 accepts only printable ASCII
    in a request target, and uvicorn writes the decoded path percent-encoded again."""
    import socket

    from rollout_service.sidecar.app import create_app
    from rollout_service.sidecar.settings import SidecarSettings
    from sidecar_helpers import uvicorn_served

    settings = SidecarSettings(checkpoint_path=tmp_path, sglang_url="http://127.0.0.1:1", replica_id="r", stage=False)
    access = logging.getLogger("uvicorn.access")
    shown: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            shown.append(access.handlers[0].format(record) if access.handlers else record.getMessage())

    def exchange(port: int, target: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.settimeout(10)
            conn.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        return data

    lines = Lines()
    with uvicorn_served(create_app(settings), settings) as port:
        access.addHandler(lines)
        try:
            assert exchange(port, b"/x%0A2030-01-01%1B[2K%E2%80%A8").startswith(b"HTTP/1.1 404")
            assert exchange(port, b"/x\x1b[2K").startswith(b"HTTP/1.1 400")  # h11 refuses it; nothing logged
        finally:
            access.removeHandler(lines)
    assert len(shown) == 1 and "/x%0A2030-01-01%1B%5B2K%E2%80%A8" in shown[0], shown
    uncoloured = re.sub("\x1b\\[[0-9;]*m", "", shown[0])  # uvicorn colours level and status on a terminal
    assert not CONTROLS.search(uncoloured), shown


@pytest.mark.parametrize("name", ["x\n2030.safetensors", "a\x1b[2K.safetensors", "b\u2028c.safetensors"])
def test_a_manifest_listing_a_file_name_with_control_characters_is_refused(tmp_path: Path, name: str) -> None:
    """No writer makes such a name; before, a shard so named validated (its name then needed
    escaping wherever it was shown)."""
    import json

    from rollout_service.checkpoint_format import MANIFEST_NAME, Manifest

    step = _publish(tmp_path / "root")
    manifest = json.loads((step / MANIFEST_NAME).read_text())
    manifest["files"][name] = manifest["files"].pop("model.safetensors")
    (step / "model.safetensors").rename(step / name)
    (step / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as refused:
        Manifest.load(step)
    assert refused.value.reason == "bad_manifest" and "holds control characters" in str(refused.value)
    assert not CONTROLS.search(str(refused.value))
