"""Bad values on the one-shot commands' command lines: argparse's exit 2 naming the flag, and a
setup failure on a bad path is one line naming it, never a traceback; the trainer's tokens too."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rollout_service.cli import build_parser, main

NOT_POSITIVE_OR_FINITE = ["nan", "inf", "-inf", "0", "-1"]

NUMBER_FLAGS = {
    "validate --timeout": ["validate", "DIR", "--timeout"],
    "materialize --timeout": ["materialize", "ROOT", "--step", "1", "--out", "OUT", "--timeout"],
    "liveness --timeout": ["liveness", "--timeout"],
    "publish --max-shard-mb": ["publish", "--model-dir", "M", "--checkpoint-path", "C", "--step=1", "--max-shard-mb"],
}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("value", NOT_POSITIVE_OR_FINITE)
@pytest.mark.parametrize("where", sorted(NUMBER_FLAGS))
def test_a_number_flag_refuses_values_that_are_not_finite_and_positive(
    capsys: pytest.CaptureFixture[str], where: str, value: str
) -> None:
    argv = NUMBER_FLAGS[where]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv[:-1], f"{argv[-1]}={value}"])  # "--timeout=-inf": not an option
    assert exc.value.code == 2
    assert f"argument {argv[-1]}: must be a finite number from " in capsys.readouterr().err


@pytest.mark.parametrize("where", sorted(NUMBER_FLAGS))
def test_a_number_flag_takes_a_positive_number(where: str) -> None:
    args = build_parser().parse_args([*NUMBER_FLAGS[where], "2.5"])
    assert getattr(args, NUMBER_FLAGS[where][-1].lstrip("-").replace("-", "_")) == 2.5


def test_make_tiny_model_seed_is_documented_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["make-tiny-model", "--out", "o", "--seed", "7"]).seed == 7
    with pytest.raises(SystemExit):
        build_parser().parse_args(["make-tiny-model", "--out", "o", "--seed", "-1"])
    assert "argument --seed: must be a finite number from 0 to" in capsys.readouterr().err


def test_every_option_of_every_command_has_help() -> None:
    for name, parser in subcommands().items():
        undocumented = [a.option_strings for a in parser._actions if a.dest != "help" and not (a.help or "").strip()]
        assert undocumented == [], name


def test_an_unknown_log_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--log-level", "debug", "liveness"]).log_level == "DEBUG"
    for alias, level in (("warn", "WARNING"), ("FATAL", "CRITICAL")):  # Python's own aliases
        assert build_parser().parse_args(["--log-level", alias, "liveness"]).log_level == level
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "bogus", "liveness"])
    assert "argument --log-level: invalid choice: 'BOGUS'" in capsys.readouterr().err


def test_serve_with_a_checkpoint_path_under_a_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main(["serve", "--model", "m", "--checkpoint-path", str(a_file / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot create --checkpoint-path {a_file / 'x'}: Not a directory")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("field", ["sidecar_token", "sglang_api_token"])
def test_the_trainer_refuses_a_token_no_header_can_carry(tmp_path: Path, field: str) -> None:
    from trainer_helpers import make_config

    with pytest.raises(ValueError, match=f"^{field} contains 'ä'"):
        make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], **{field: "pässwort"})
    config = make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], **{field: "s3cret"})
    assert getattr(config, field) == "s3cret"


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--port", "70000"),
        ("--restart-window", "nan"),
        ("--startup-timeout", "-5"),
        ("--max-total-tokens", "-1"),
        ("--max-restarts", "-1"),
        ("--sidecar-port", "0"),
    ],
)
def test_serve_refuses_numbers_outside_their_range_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--model", "m", "--checkpoint-path", "/tmp/r", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be a finite number from" in capsys.readouterr().err
