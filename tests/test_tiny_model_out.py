"""`rollout-service make-tiny-model --out DIR`: it never changes or exposes what DIR already
holds, never leaves a half-built model under DIR's name, and a rerun (a compose service that is
started again on its volume, an init container that runs again in its pod) keeps the model it
built.

Driven in-process through ``cli.main``. Most tests stand a stub in for the tokenizer (training
the real one takes seconds and is not what they check); one builds the real model.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from rollout_service import tiny_model
from rollout_service.cli import main


class StubTokenizer:
    """Enough of a tokenizer for `make_tiny_model`: three special tokens, one file written
    (or a full disk, with ``fail``)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def __len__(self) -> int:
        return len(tiny_model.SPECIAL_TOKENS)

    def convert_tokens_to_ids(self, token: str) -> int:
        return tiny_model.SPECIAL_TOKENS.index(token)

    def save_pretrained(self, folder: Any) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        Path(folder, "tokenizer.json").write_text("{}")


@pytest.fixture
def stub_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_model, "build_tokenizer", lambda vocab_size=4096: StubTokenizer())


def snapshot(folder: Path) -> dict[str, Any]:
    """Every entry under ``folder`` (itself included): mode, inode, mtime and file contents."""
    out: dict[str, Any] = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        st = path.lstat()
        out[str(path.relative_to(folder))] = (
            stat.S_IMODE(st.st_mode),
            st.st_ino,
            st.st_mtime_ns,
            path.read_bytes() if path.is_file() else None,
        )
    return out


def make(capsys: pytest.CaptureFixture[str], out: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["make-tiny-model", "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_folder_that_holds_something_is_refused_and_left_exactly_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stub_tokenizer: None
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    victim.chmod(0o1700)
    (victim / "credentials").write_text("secret\n")
    (victim / "credentials").chmod(0o600)
    (victim / "model-00001-of-00002.safetensors").write_text("x\n")
    (victim / "config.json").write_text('{"my":"config"}\n')
    before = snapshot(victim)
    code, out, err = make(capsys, victim)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert f"{victim} already exists and is not empty" in err and "does not exist yet" in err, err
    assert snapshot(victim) == before
    assert sorted(os.listdir(tmp_path)) == ["victim"], "a hidden build folder was left behind"
    # A file where the folder should go: refused too.
    (tmp_path / "a-file").write_text("mine")
    code, out, err = make(capsys, tmp_path / "a-file")
    assert code == 2 and "is not a folder" in err and (tmp_path / "a-file").read_text() == "mine", err


def test_a_failed_build_leaves_nothing_under_the_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The weights are written, then the tokenizer fails (a full disk): nothing half-built shows.
    monkeypatch.setattr(tiny_model, "build_tokenizer", lambda vocab_size=4096: StubTokenizer(fail=True))
    out = tmp_path / "models" / "tiny"
    code, _, err = make(capsys, out)
    assert code == 2 and "No space left on device" in err, err
    assert not out.exists() and os.listdir(tmp_path / "models") == []
    # An empty folder given as --out is still there, empty, with its mode, after a failed build.
    out.mkdir()
    out.chmod(0o2750)
    code, _, err = make(capsys, out)
    assert code == 2 and "No space left on device" in err, err
    assert out.is_dir() and os.listdir(out) == [] and stat.S_IMODE(out.stat().st_mode) == 0o2750
    assert os.listdir(tmp_path / "models") == ["tiny"]


def test_an_empty_folder_is_filled_and_keeps_its_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stub_tokenizer: None
) -> None:
    out = tmp_path / "tiny"
    out.mkdir()
    out.chmod(0o750)
    code, printed, err = make(capsys, out, "--tied")
    assert code == 0 and printed.strip() == str(out), err
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    names = sorted(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tiny_model_params.json"} <= set(names), names
    for name in names:
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    assert json.loads((out / "tiny_model_params.json").read_text())["tied"] is True
    assert os.listdir(tmp_path) == ["tiny"]


def test_a_rerun_keeps_the_model_it_built_and_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "models" / "tiny"
    code, printed, err = make(capsys, out)  # the real tokenizer, trained here
    assert code == 0 and printed.strip() == str(out), err
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # a folder it made: readable by other users
    built = snapshot(out)
    assert "model.safetensors" in built and "tokenizer.json" in built
    # The compose service or init container runs again on the same volume: the model is kept.
    code, printed, err = make(capsys, out)
    assert code == 0 and printed.strip() == str(out), err
    assert snapshot(out) == built
    # Other arguments would give another model: refused, the folder untouched.
    code, printed, err = make(capsys, out, "--seed", "1")
    assert code == 2 and "already exists and is not empty" in err, err
    assert snapshot(out) == built
    assert os.listdir(tmp_path / "models") == ["tiny"]
