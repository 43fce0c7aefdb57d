"""The commands' usage errors name what was wrong with what the user typed (a review of the CLI):

- an empty path argument meant the current directory: ``publish --checkpoint-path ""`` published
  into it, ``validate --reference ""`` compared nothing and said the step was valid;
- ``materialize`` blamed the step (exit 1, "missing_manifest") for a ROOT that does not exist, is
  a file, or is a step folder; ``validate --root`` pointing nowhere was a "path_escape"; and
  ``validate ROOT`` said "publish with `rollout-service publish`" instead of naming a step;
- errors built from an ``OSError`` showed Python's ``[Errno 20]`` prefix;
- ``make-tiny-model --out .`` said "the empty folder ." although it was not empty;
- SGLang's flags given to ``serve`` without ``--`` were only "unrecognized";
- the sidecar's missing root named neither ``--checkpoint-path`` nor its variable.

None of them starts SGLang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollout_service.checkpoint_format import step_dir_name
from rollout_service.cli import main
from rollout_service.cli_env import ENV_PREFIX
from rollout_service.sidecar.settings import SidecarSettings
from test_cli_validate_kinds import cli_reason, publish_delta_chain


@pytest.fixture(autouse=True)
def no_rollout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    publish_delta_chain(root)  # step 1 full, step 2 a delta on it
    return root


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's refusal of ``argv`` (exit 2): its stderr."""
    with pytest.raises(SystemExit) as stopped:
        main(list(argv))
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ("publish", "--model-dir", "M", "--checkpoint-path", "", "--step", "7"),
        ("publish", "--model-dir", " ", "--checkpoint-path", "C", "--step", "7"),
        ("validate", "S", "--reference", ""),
        ("validate", ""),
        ("validate", "S", "--root", ""),
        ("materialize", "", "--step", "1", "--out", "x"),
        ("materialize", "R", "--step", "1", "--out", ""),
        ("make-tiny-model", "--out", ""),
    ],
)
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(
    argv: tuple[str, ...], tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    err = usage_error(capsys, *argv)
    assert "must not be empty" in err and "current directory" in err, err
    assert os.listdir(tmp_path) == []  # before: publish wrote step-00000007 here


def test_validate_with_an_empty_reference_does_not_pass_unchecked(root: Path, tmp_path: Path, capsys) -> None:
    """A script's ``--reference "$BASE"`` with ``BASE`` unset: refused, where it said "valid"."""
    step = str(root / step_dir_name(1))
    assert cli_reason(capsys, "validate", step)[0] == 0  # the step itself is fine
    assert "--reference" in usage_error(capsys, "validate", step, "--reference", "")


def test_materialize_names_a_root_that_is_missing_a_file_or_a_step(root: Path, tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "model")
    code, err = cli_reason(capsys, "materialize", str(tmp_path / "nowhere"), "--step", "1", "--out", out)
    assert code == 2 and "ROOT" in err and "does not exist" in err and "missing_manifest" not in err, err
    (tmp_path / "afile").write_text("x")
    code, err = cli_reason(capsys, "materialize", str(tmp_path / "afile"), "--step", "1", "--out", out)
    assert code == 2 and "is not a directory" in err, err
    step = root / step_dir_name(1)
    code, err = cli_reason(capsys, "materialize", str(step), "--step", "1", "--out", out)
    assert code == 2 and "is a published step" in err and f"give its parent, {root}" in err, err
    assert not os.path.lexists(out)
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "9", "--out", out)  # a step the root lacks
    assert code == 1 and "missing_manifest" in err, err
    code, out_json = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", out)
    assert code == 0 and json.loads(out_json)["step"] == 2, out_json


def test_validate_names_a_root_flag_pointing_nowhere(root: Path, tmp_path: Path, capsys) -> None:
    step = str(root / step_dir_name(1))
    code, err = cli_reason(capsys, "validate", step, "--root", str(tmp_path / "nowhere"))
    assert code == 2 and "--root" in err and "does not exist" in err and "path_escape" not in err, err
    code, err = cli_reason(capsys, "validate", step, "--root", str(root / step_dir_name(1) / "manifest.json"))
    assert code == 2 and "--root" in err and "is not a directory" in err, err
    assert cli_reason(capsys, "validate", step, "--root", str(root))[0] == 0


def test_validate_given_the_root_names_one_of_its_steps(root: Path, capsys) -> None:
    code, err = cli_reason(capsys, "validate", str(root))
    assert code == 1 and "looks like a checkpoint root" in err and str(root / step_dir_name(1)) in err, err
    code, err = cli_reason(capsys, "validate", str(root / step_dir_name(1) / "nothing"))  # no root: no hint
    assert code == 1 and "checkpoint root" not in err, err


def test_os_errors_show_no_errno_prefix(root: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    code, err = cli_reason(capsys, "materialize", str(root), "--step", "2", "--out", str(tmp_path / "afile" / "m"))
    assert code == 2 and "[Errno" not in err and "not a directory" in err.lower(), err


def test_make_tiny_model_into_dot_says_to_name_the_new_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "something").write_text("x")
    for out in (".", "..", "sub/.."):
        code, err = cli_reason(capsys, "make-tiny-model", "--out", out)
        assert code == 2 and "end it with the name of the new directory" in err and "empty folder" not in err, err
    assert os.listdir(tmp_path) == ["something"]


def test_sglang_flags_given_to_serve_without_the_separator_are_explained(tmp_path: Path, capsys) -> None:
    err = usage_error(capsys, "serve", "--model", "M", "--checkpoint-path", str(tmp_path), "--tp-size", "2")
    assert "unrecognized arguments: --tp-size 2" in err and "-- --tp-size 2" in err, err
    err = usage_error(capsys, "validate", "S", "--tp-size", "2")  # a command that takes no SGLang flags
    assert "unrecognized arguments: --tp-size 2" in err and "SGLang" not in err, err


def test_the_sidecars_root_error_names_the_flag_and_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--checkpoint-path \(ROLLOUT_CHECKPOINT_PATH\) .* does not exist"):
        SidecarSettings(checkpoint_path=tmp_path / "nowhere", sglang_url="http://127.0.0.1:9", stage=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--checkpoint-path \(ROLLOUT_CHECKPOINT_PATH\) .* is not a directory"):
        SidecarSettings(checkpoint_path=tmp_path / "afile", sglang_url="http://127.0.0.1:9", stage=False)


def test_make_tiny_model_prints_only_the_models_path_on_stdout(tmp_path: Path) -> None:
    """``MODEL=$(rollout-service make-tiny-model --out x)`` held DeepSpeed's accelerator warning too."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rollout_service.cli", "make-tiny-model", "--out", str(tmp_path / "tiny")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{tmp_path / 'tiny'}\n", out.stdout
