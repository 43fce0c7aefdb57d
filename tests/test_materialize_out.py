"""``rollout-service materialize``'s ``--out``: refused up front when it cannot work, cleaned up
when the run fails, and reported as done when an interrupt lands after the model was complete.

Also what a full or failing disk under a rebuild says (``materialize`` and ``validate --digests``):
where it was writing and what to do, not only an errno.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest

from rollout_service import delta_apply
from rollout_service.checkpoint_format import step_dir_name
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service.cli import main
from test_cli_validate_kinds import cli_reason, publish_delta_chain


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    publish_delta_chain(root)  # step 1 full, step 2 a delta on it
    return root


def test_an_out_with_dot_dot_or_a_name_too_long_is_refused_before_any_work(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(tmp_path / "new" / ".."))
    assert code == 2 and "'..'" in err, err
    assert not (tmp_path / "new").exists()  # before: rebuilt, then EBUSY, and "new" was left behind
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(tmp_path / ("n" * 256)))
    assert code == 2 and "at most 255 bytes" in err, err
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_an_out_given_relative_to_a_parent_folder_works(
    root: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code, printed = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", "../models/m")
    assert code == 0, printed
    assert validate_checkpoint(tmp_path / "models" / "m").manifest.step == 2


def test_an_out_name_as_long_as_a_name_may_be_works(root: Path, tmp_path: Path, capsys) -> None:
    """The hidden work folder beside ``--out`` is named after it: cut short, so that a long but
    valid name still fits (before: ENAMETOOLONG naming the hidden folder)."""
    out = tmp_path / ("m" * 240)
    code, printed = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(out))
    assert code == 0, printed
    assert json.loads(printed)["step"] == 2 and validate_checkpoint(out).manifest.step == 2


def test_a_failed_run_removes_the_folders_it_made_for_out(root: Path, tmp_path: Path, capsys) -> None:
    (root / step_dir_name(1) / "model.safetensors").write_bytes(b"damaged")  # the chain's full step
    out = tmp_path / "made" / "for" / "out"
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(out))
    assert code == 1, err
    assert not (tmp_path / "made").exists(), os.listdir(tmp_path)
    kept = tmp_path / "kept"
    kept.mkdir()  # a folder that was there before is left alone
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(kept / "x" / "out"))
    assert code == 1 and kept.is_dir() and os.listdir(kept) == [], err


def test_an_interrupt_after_the_rename_reports_the_model_as_done(
    root: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM landing right after the complete model got its name: it stays, and the run says so
    (exit 0, its JSON line), as ``publish`` does; before, it said "nothing half-done was left"
    (exit 143) and a retry was refused because ``--out`` exists."""
    real_rename = os.rename
    out = tmp_path / "model"

    def rename_then_sigterm(src, dst, *args, **kw):
        real_rename(src, dst, *args, **kw)
        if Path(dst) == out:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(delta_apply.os, "rename", rename_then_sigterm)
    code = main(["materialize", str(root), "--step", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "interrupted by SIGTERM after" in captured.err and "it stays" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 2
    assert validate_checkpoint(out, check_digests=True).manifest.step == 2


def test_an_interrupt_before_the_rename_still_leaves_nothing(
    root: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal should have interrupted the run")

    monkeypatch.setattr(delta_apply, "reconstruct", interrupted)
    code = main(["materialize", str(root), "--step", "2", "--out", str(tmp_path / "model")])
    assert code == 128 + signal.SIGTERM
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_another_run_that_finished_first_is_named_as_such(
    root: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_rename = os.rename
    out = tmp_path / "model"

    def other_run_first(src, dst, *args, **kw):
        if Path(dst) == out:
            out.mkdir()
            (out / "config.json").write_text("{}")
        return real_rename(src, dst, *args, **kw)

    monkeypatch.setattr(delta_apply.os, "rename", other_run_first)
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(out))
    assert code == 2 and "was made by another run meanwhile" in err, err
    assert sorted(os.listdir(tmp_path)) == ["model", "root"]  # its work folder is gone


def test_a_full_disk_names_where_it_was_writing(root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import tempfile

    def no_room(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(delta_apply, "reconstruct", no_room)
    out = tmp_path / "model"
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(out))
    assert code == 2 and "No space left on device" in err and str(tmp_path) in err and "free room" in err, err
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(2)), "--digests")
    assert code == 2 and "No space left on device" in err and str(scratch) in err and "TMPDIR" in err, err
    assert os.listdir(scratch) == []


def test_an_error_about_the_root_is_not_blamed_on_out(root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    def unreadable(*args, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(root / step_dir_name(1)))

    monkeypatch.setattr(delta_apply, "resolve_chain", unreadable)
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(tmp_path / "model"))
    assert code == 2 and str(root / step_dir_name(1)) in err and "free room" not in err, err


def test_an_interrupt_after_another_roots_copy_took_the_name_is_not_reported_as_done(
    root: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run, from another root, put its step 2 at ``--out`` first; this run is interrupted
    before its own rename: the model there is not the one asked for (another publication of step
    2), and the run says it stopped."""
    other = tmp_path / "other-root"
    publish_delta_chain(other)
    prepared = tmp_path / "prepared"
    delta_apply.materialize(other, 2, prepared)
    out = tmp_path / "model"

    def other_then_interrupt(*args, **kw):
        os.rename(prepared, out)
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal should have interrupted the run")

    monkeypatch.setattr(delta_apply, "reconstruct", other_then_interrupt)
    code = main(["materialize", str(root), "--step", "2", "--out", str(out)])
    assert code == 128 + signal.SIGTERM, capsys.readouterr().err
