"""Settings are declared once, as dataclass fields (SidecarSettings; serve's RestartPolicy and
LoraServing too), and their flags and ROLLOUT_* variables derived from that declaration: each
setting has one flag and one variable on each command, the variable sets the value, the flag wins
over it, a bad value names the variable, --help lists it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollout_service.cli import SERVE_RESTART_SETTINGS, SERVE_SIDECAR_SETTINGS, SIDECAR_SETTINGS, build_parser
from rollout_service.cli_env import (
    ENV_PREFIX,
    EnvArgumentParser,
    SettingFlags,
    add_env_argument,
    declared_bounds,
    declared_settings,
    env_name,
    setting,
)
from rollout_service.lora_serving import DEFAULT_TARGET_MODULES, LoraServing, lora_from_args, module_list
from rollout_service.serve import RestartPolicy
from rollout_service.sidecar.settings import SidecarSettings

NOT_ON_THE_COMMAND_LINE = {"ack_interval_s", "request_timeout_s"}
"""SidecarSettings fields that are tuning knobs for tests and embedders, deliberately without a flag."""

FIELDS = {f.name for f in dataclasses.fields(SidecarSettings)}
SETTINGS = {f.name for f, _ in declared_settings(SidecarSettings)}


def subparser(command: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("no subcommands")


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings if flag.startswith("--")}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / name for name in ("ckpt", "ckpt2", "ref", "ref2", "stage", "stage2")}
    for path in paths.values():
        path.mkdir()
    return paths


def values(dirs: dict[str, Path]) -> dict[str, tuple[str, Any, str, Any]]:
    """field -> (variable's text, value it gives, flag's text, value it gives); None text: a switch."""
    return {
        "checkpoint_path": (str(dirs["ckpt"]), dirs["ckpt"], str(dirs["ckpt2"]), dirs["ckpt2"]),
        "sglang_url": ("http://env:1", "http://env:1", "http://flag:2/", "http://flag:2"),
        "replica_id": ("from-env", "from-env", "from-flag", "from-flag"),
        "poll_interval_s": ("2.5", 2.5, "7", 7.0),
        "host": ("0.0.0.0", "0.0.0.0", "10.0.0.1", "10.0.0.1"),
        "port": ("8201", 8201, "8202", 8202),
        "token": ("env-token", "env-token", "flag-token", "flag-token"),
        "sglang_api_key": ("env-key", "env-key", "flag-key", "flag-key"),
        "reference_dir": (str(dirs["ref"]), dirs["ref"], str(dirs["ref2"]), dirs["ref2"]),
        "check_digests": ("yes", True, "", True),
        "health_interval_s": ("3.5", 3.5, "4", 4.0),
        "deep_health_interval_s": ("31", 31.0, "32", 32.0),
        "load_timeout_s": ("99", 99.0, "98", 98.0),
        "stage": ("on", False, "", False),
        "stage_dir": (str(dirs["stage"]), dirs["stage"], str(dirs["stage2"]), dirs["stage2"]),
        "stage_max_gb": ("60", 60.0, "0.5", 0.5),
        "check_finite": ("1", False, "", False),
        "validate_timeout_s": ("12", 12.0, "13", 13.0),
        "root_timeout_s": ("3", 3.0, "4.5", 4.5),
        "lora_keep": ("5", 5, "6", 6),
    }


REQUIRED = {"checkpoint_path": "--checkpoint-path", "sglang_url": "--sglang-url"}


def required_argv(dirs: dict[str, Path], *, skip: str = "") -> list[str]:
    argv = []
    if skip != "checkpoint_path":
        argv += ["--checkpoint-path", str(dirs["ckpt"])]
    if skip != "sglang_url":
        argv += ["--sglang-url", "http://127.0.0.1:1"]
    return argv


# ------------------------------------------------------------------------------ the derivation


def test_every_field_is_a_setting_or_deliberately_off_the_command_line(dirs):
    assert FIELDS - SETTINGS == NOT_ON_THE_COMMAND_LINE
    assert set(values(dirs)) == SETTINGS, "each setting needs a row in values() above"


def test_every_setting_has_exactly_one_flag_and_one_variable_on_each_command():
    for command, derived, expected in [
        ("sidecar", SIDECAR_SETTINGS, SETTINGS),
        ("serve", SERVE_SIDECAR_SETTINGS, SETTINGS - {"sglang_url"}),
    ]:
        assert [spec.field for spec in derived.flags] == [
            f.name for f, _ in declared_settings(SidecarSettings) if f.name in expected
        ]
        parser = subparser(command)
        actions = flag_actions(parser)
        envs = [spec.env for spec in parser.env_flags]
        assert len(envs) == len(set(envs)), f"{command}: a variable names two flags"
        for spec in derived.flags:
            assert [a for a in parser._actions if a.dest == spec.dest] == [actions[spec.flag]], (command, spec)
            assert actions[spec.flag].option_strings == [spec.flag]
            assert spec.env == env_name(spec.flag) and envs.count(spec.env) == 1, (command, spec)
            assert spec.help in actions[spec.flag].help


def test_flag_and_variable_names_stay_what_users_and_deploy_files_use():
    sidecar = {spec.field: spec.env for spec in SIDECAR_SETTINGS.flags}
    serve = {spec.field: spec.env for spec in SERVE_SIDECAR_SETTINGS.flags}
    assert sidecar["checkpoint_path"] == serve["checkpoint_path"] == "ROLLOUT_CHECKPOINT_PATH"
    assert sidecar["poll_interval_s"] == "ROLLOUT_POLL"
    assert sidecar["stage"] == "ROLLOUT_NO_STAGE" and sidecar["check_finite"] == "ROLLOUT_NO_CHECK_FINITE"
    assert (sidecar["port"], serve["port"]) == ("ROLLOUT_PORT", "ROLLOUT_SIDECAR_PORT")
    assert "sglang_url" not in serve  # serve's sidecar talks to the SGLang it starts


def test_help_of_each_command_lists_every_settings_variable_and_its_default():
    for command, derived in [("sidecar", SIDECAR_SETTINGS), ("serve", SERVE_SIDECAR_SETTINGS)]:
        text = " ".join(subparser(command).format_help().split())
        for spec in derived.flags:
            assert spec.flag in text and f"[env {spec.env}" in text, (command, spec.env)
        assert "--checkpoint-path CHECKPOINT_PATH checkpoint root" in text
    sidecar = " ".join(subparser("sidecar").format_help().split())
    assert "(required) [env ROLLOUT_SGLANG_URL]" in sidecar
    assert "[env ROLLOUT_LOAD_TIMEOUT; default 1800.0]" in sidecar
    assert "[env ROLLOUT_REPLICA_ID]" in sidecar  # an empty default is not shown


# ------------------------------------------------------------------------ values, env and flags


def test_defaults_are_the_dataclass_defaults(clean_env, dirs):
    built = SIDECAR_SETTINGS.build(build_parser().parse_args(["sidecar", *required_argv(dirs)]))
    direct = SidecarSettings(checkpoint_path=dirs["ckpt"], sglang_url="http://127.0.0.1:1")
    assert built == direct


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_variable_sets_the_setting_and_the_flag_wins_over_it(clean_env, dirs, name):
    env_text, env_value, flag_text, flag_value = values(dirs)[name]
    (spec,) = [s for s in SIDECAR_SETTINGS.flags if s.field == name]
    clean_env.setenv(spec.env, env_text)
    args = build_parser().parse_args(["sidecar", *required_argv(dirs, skip=name)])
    assert getattr(SIDECAR_SETTINGS.build(args), name) == env_value
    flag = [spec.flag] if spec.parse is None else [spec.flag, flag_text]
    if spec.parse is None:  # a switch given on the command line wins over a variable that says no
        clean_env.setenv(spec.env, "0")
    args = build_parser().parse_args(["sidecar", *required_argv(dirs, skip=name), *flag])
    assert getattr(SIDECAR_SETTINGS.build(args), name) == flag_value


def test_serve_reads_the_sidecar_port_from_its_own_variable(clean_env, dirs):
    clean_env.setenv("ROLLOUT_PORT", "30001")  # serve: SGLang's port
    clean_env.setenv("ROLLOUT_SIDECAR_PORT", "8105")
    clean_env.setenv("ROLLOUT_POLL", "3")
    args = build_parser().parse_args(["serve", "--model", "m", "--checkpoint-path", str(dirs["ckpt"])])
    built = SERVE_SIDECAR_SETTINGS.build(args, sglang_url="http://127.0.0.1:30001")
    assert (args.port, built.port, built.poll_interval_s, built.sglang_url) == (
        30001,
        8105,
        3.0,
        "http://127.0.0.1:30001",
    )


NOT_TEXT = sorted(
    name
    for name, hint in typing.get_type_hints(SidecarSettings).items()
    if name in SETTINGS and not {str, Path} & set(typing.get_args(hint) or (hint,))
)
"""The settings a word like 'not-a-number' is not valid for (numbers and switches)."""


@pytest.mark.parametrize("name", NOT_TEXT)
def test_a_bad_variable_is_refused_naming_it(clean_env, dirs, capsys, name):
    (spec,) = [s for s in SIDECAR_SETTINGS.flags if s.field == name]
    clean_env.setenv(spec.env, "not-a-number")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["sidecar", *required_argv(dirs, skip=name)])
    assert exc.value.code == 2
    assert f"environment variable {spec.env}='not-a-number' is not valid for {spec.flag}" in capsys.readouterr().err


NUMBERS = sorted(
    name
    for name, hint in typing.get_type_hints(SidecarSettings).items()
    if name in SETTINGS and {int, float} & set(typing.get_args(hint) or (hint,))
)
LAX_NUMBERS = ["1_0", "\u0663", "\u00b2", "0x10", "1 0"]
"""Texts Python's int() or float() reads as another number than a person means (or crashes on):
an underscore, an Arabic-Indic digit, a superscript, hex; a flag or variable refuses each."""


@pytest.mark.parametrize("text", LAX_NUMBERS)
@pytest.mark.parametrize("name", NUMBERS)
def test_a_number_setting_takes_plain_decimal_digits_only(clean_env, dirs, capsys, name, text):
    (spec,) = [s for s in SIDECAR_SETTINGS.flags if s.field == name]
    argv = ["sidecar", *required_argv(dirs)]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, spec.flag, text])
    assert exc.value.code == 2 and f"argument {spec.flag}: invalid" in capsys.readouterr().err
    clean_env.setenv(spec.env, text)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and f"environment variable {spec.env}={text!r} is not valid" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--port", "--max-total-tokens", "--max-restarts", "--restart-window", "--sidecar-port"]
)
def test_serves_number_flags_take_plain_decimal_digits_only(clean_env, dirs, capsys, flag):
    argv = ["serve", "--model", "m", "--checkpoint-path", str(dirs["ckpt"])]
    for text in ("1_0", "\u0663"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args([*argv, flag, text])
        assert exc.value.code == 2 and f"argument {flag}: invalid" in capsys.readouterr().err
    assert build_parser().parse_args([*argv, flag, "100"]) is not None


def test_a_number_setting_still_takes_a_sign_spaces_a_fraction_and_an_exponent(clean_env, dirs):
    clean_env.setenv("ROLLOUT_PORT", " 8105\n")  # a variable written by a YAML block scalar
    args = build_parser().parse_args(["sidecar", *required_argv(dirs), "--poll", "+2.5e0"])
    built = SIDECAR_SETTINGS.build(args)
    assert (built.port, built.poll_interval_s) == (8105, 2.5)
    for flag in ("--poll", "--health-interval"):
        with pytest.raises(SystemExit):  # read, then refused as not finite
            build_parser().parse_args(["sidecar", *required_argv(dirs), flag, "nan"])


@pytest.mark.parametrize(("command", "text"), [("publish", "7_0"), ("materialize", "\u0667"), ("publish", "-1")])
def test_a_step_flag_is_refused_unless_it_is_a_step_in_digits(capsys, command, text):
    argv = {
        "publish": ["publish", "--model-dir", "m", "--checkpoint-path", "c"],
        "materialize": ["materialize", "root", "--out", "o"],
    }[command]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--step", text])
    assert exc.value.code == 2 and "argument --step:" in capsys.readouterr().err
    assert build_parser().parse_args([*argv, "--step", "70"]).step == 70


def test_the_bad_variable_cases_cover_numbers_and_switches():
    assert {"port", "poll_interval_s", "lora_keep", "check_digests", "stage"} <= set(NOT_TEXT)


def test_empty_values_mean_unset(clean_env, dirs):
    clean_env.setenv("ROLLOUT_POLL", "")
    clean_env.setenv("ROLLOUT_PORT", "")
    args = build_parser().parse_args(["sidecar", *required_argv(dirs), "--reference-dir", "", "--stage-dir", ""])
    built = SIDECAR_SETTINGS.build(args)
    assert (built.poll_interval_s, built.port, built.reference_dir) == (None, 8100, None)
    assert built.stage_dir is not None and built.stage_dir != Path()  # the default stage folder


def test_a_missing_required_setting_names_its_flag_and_variable(clean_env, dirs, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar", "--checkpoint-path", str(dirs["ckpt"])])
    assert "--sglang-url (or ROLLOUT_SGLANG_URL)" in capsys.readouterr().err


def test_serve_restart_and_lora_settings_are_derived_from_their_dataclasses(clean_env, dirs):
    assert [s.field for s in SERVE_RESTART_SETTINGS.flags] == [
        "max_restarts",
        "restart_window_s",
        "startup_timeout_s",
        "hang_timeout_s",
    ]
    assert {f.name for f, _ in declared_settings(LoraServing)} == {f.name for f in dataclasses.fields(LoraServing)}
    serve = subparser("serve")
    text = " ".join(serve.format_help().split())
    for name in (
        "ROLLOUT_MAX_RESTARTS",
        "ROLLOUT_RESTART_WINDOW",
        "ROLLOUT_STARTUP_TIMEOUT",
        "ROLLOUT_HANG_TIMEOUT",
        "ROLLOUT_LORA_BACKEND",
    ):
        assert f"[env {name}" in text and [e.env for e in serve.env_flags].count(name) == 1
    argv = ["serve", "--model", "m", "--checkpoint-path", str(dirs["ckpt"])]
    clean_env.setenv("ROLLOUT_MAX_RESTARTS", "2")
    clean_env.setenv("ROLLOUT_STARTUP_TIMEOUT", "900")
    clean_env.setenv("ROLLOUT_LORA", "1")
    clean_env.setenv("ROLLOUT_LORA_TARGET_MODULES", "q_proj v_proj")
    args = build_parser().parse_args([*argv, "--startup-timeout", "1200", "--max-lora-rank", "8"])
    assert SERVE_RESTART_SETTINGS.build(args) == RestartPolicy(max_restarts=2, startup_timeout_s=1200.0)
    assert lora_from_args(args) == LoraServing(max_rank=8, target_modules=("q_proj", "v_proj"))
    clean_env.setenv("ROLLOUT_LORA", "0")
    clean_env.delenv("ROLLOUT_LORA_TARGET_MODULES")  # a LoRA setting without --lora is refused
    assert lora_from_args(build_parser().parse_args(argv)) is None


def test_serve_sglang_settings_are_derived_from_the_server_config(clean_env, dirs):
    from rollout_service.cli import SERVE_SGLANG_SETTINGS
    from rollout_service.sglang_launcher import SGLangServerConfig

    flags = {s.field: s.flag for s in SERVE_SGLANG_SETTINGS.flags}
    assert flags == {
        "model_path": "--model",
        "host": "--sglang-host",
        "port": "--port",
        "device": "--device",
        "max_total_tokens": "--max-total-tokens",
        "log_path": "--sglang-log",
    }
    argv = ["serve", "--checkpoint-path", str(dirs["ckpt"])]
    clean_env.setenv("ROLLOUT_MODEL", "/models/base")
    clean_env.setenv("ROLLOUT_MAX_TOTAL_TOKENS", "2048")
    got = SERVE_SGLANG_SETTINGS.values(build_parser().parse_args([*argv, "--device", "cpu"]))
    # serve's own default port (the library's default, None, picks a free one); the rest are the config's.
    library = SGLangServerConfig("/models/base")
    assert got == {
        "model_path": "/models/base",
        "host": library.host,
        "port": 30000,
        "device": "cpu",
        "max_total_tokens": 2048,
        "log_path": None,
    }
    assert library.port is None and library.max_total_tokens == 16384
    log = dirs["ckpt"] / "sglang.log"
    got = SERVE_SGLANG_SETTINGS.values(build_parser().parse_args([*argv, "--sglang-log", str(log), "--port", "1234"]))
    assert got["log_path"] == log and got["port"] == 1234
    with pytest.raises(TypeError, match="no fields"):
        SettingFlags(SGLangServerConfig, defaults={"prot": 1})


# ------------------------------------------------------------------- declarations it refuses


def _parser() -> EnvArgumentParser:
    return EnvArgumentParser(prog="t")


def test_a_switch_must_be_named_after_the_default_it_flips():
    @dataclass
    class Wrong:
        on: bool = field(default=True, metadata=setting("--on", "x"))

    with pytest.raises(TypeError, match="--no-"):
        SettingFlags(Wrong)

    @dataclass
    class Right:
        on: bool = field(default=True, metadata=setting("--no-on", "x"))
        off: bool = field(default=False, metadata=setting("--off", "y"))

    flags = SettingFlags(Right)
    parser = _parser()
    flags.add_to(parser)
    assert flags.build(parser.parse_args(["--no-on", "--off"])) == Right(on=False, off=True)
    assert flags.build(parser.parse_args([])) == Right()


def test_a_type_without_a_text_conversion_needs_parse_and_unknown_fields_are_refused():
    @dataclass
    class Modules:
        names: tuple[str, ...] = field(default=("a",), metadata=setting("--names", "x"))

    with pytest.raises(TypeError, match="parse="):
        SettingFlags(Modules)

    @dataclass
    class Parsed:
        names: tuple[str, ...] = field(
            default=("a",), metadata=setting("--names", "x", parse=lambda t: tuple(t.split(",")))
        )

    flags = SettingFlags(Parsed)
    parser = _parser()
    flags.add_to(parser)
    assert flags.build(parser.parse_args(["--names", "b,c"])).names == ("b", "c")
    with pytest.raises(TypeError, match="no fields"):
        SettingFlags(Parsed, exclude={"nope"})


@pytest.mark.parametrize("host", ["not a host", "1.2.3", "a..b", ""])
def test_a_bind_host_that_is_no_address_is_refused_naming_its_flag(tmp_path: Path, host: str) -> None:
    from rollout_service.sglang_launcher import SGLangServerConfig

    with pytest.raises(ValueError, match=r"--sglang-host .* is neither an IP address nor a host name"):
        SGLangServerConfig(tmp_path, host=host)


def test_an_ipv6_sglang_host_gets_a_url_with_brackets(tmp_path: Path) -> None:
    from rollout_service.http_urls import check_http_url
    from rollout_service.sglang_launcher import SGLangServer

    server = SGLangServer(tmp_path, host="::1", port=30000)
    assert server.url == "http://[::1]:30000"
    assert check_http_url(server.url, "--sglang-url") == server.url


# ------------------------------------------------------------------------------ what --help shows


def test_help_shows_a_zero_default_and_a_list_default_as_the_flag_takes_it():
    parser = _parser()
    add_env_argument(parser, "--seed", type=int, default=0, help="random seed")
    add_env_argument(parser, "--beta", type=float, default=0.0, help="beta")
    add_env_argument(parser, "--names", type=module_list, default=("q_proj", "v_proj"), help="modules")
    add_env_argument(parser, "--off", action="store_true", help="a switch")
    add_env_argument(parser, "--label", default="", help="a label")
    text = " ".join(parser.format_help().split())
    assert "[env ROLLOUT_SEED; default 0]" in text and "[env ROLLOUT_BETA; default 0.0]" in text
    assert "[env ROLLOUT_NAMES; default q_proj,v_proj]" in text
    assert "[env ROLLOUT_OFF]" in text and "[env ROLLOUT_LABEL]" in text  # False and "" are not shown
    assert "('" not in text
    assert module_list("q_proj,v_proj") == ("q_proj", "v_proj")  # the shown default is valid input


def test_serve_help_shows_the_lora_defaults_and_ranges_as_the_flags_take_them():
    text = "".join(subparser("serve").format_help().split())  # argparse wraps anywhere in a long default
    assert "[envROLLOUT_LORA_TARGET_MODULES;default" + ",".join(DEFAULT_TARGET_MODULES) + "]" in text
    assert "(1to4096)[envROLLOUT_MAX_LORA_RANK;default64]" in text
    assert "(2to1024)[envROLLOUT_MAX_LORAS_PER_BATCH;default4]" in text


def test_demo_help_shows_its_zero_seed_default():
    from rollout_demo.cli import register_demo

    sub = _parser().add_subparsers(parser_class=EnvArgumentParser)
    register_demo(sub, add_env_argument)
    text = " ".join(sub.choices["demo"].format_help().split())
    assert "--seed SEED random seed [env ROLLOUT_SEED; default 0]" in text


def test_demo_on_running_servers_needs_their_checkpoint_root(clean_env, tmp_path, capsys):
    """Before, the help promised the sidecar's root, and the demo published under its own output
    folder, where the sidecar never looks: every sync then waited out its 300 s timeout."""
    from rollout_demo.cli import main

    rc = main(
        [
            "demo",
            "--output-dir",
            str(tmp_path),
            "--sglang-url",
            "http://127.0.0.1:9",
            "--sidecar-url",
            "http://127.0.0.1:9",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "pass --checkpoint-path" in err and "checkpoint_path" in err
    assert not (tmp_path / "checkpoints").exists()


def test_serve_usage_shows_the_sglang_passthrough():
    usage = subparser("serve").format_usage()
    assert usage.rstrip().endswith("[-- SGLANG_ARGS ...]"), usage


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-lora-rank", "0", "from 1 to 4096, got 0"),
        ("--max-lora-rank", "4097", "from 1 to 4096, got 4097"),
        ("--max-loras-per-batch", "1", "from 2 to 1024, got 1"),
        ("--max-loras-per-batch", "1025", "from 2 to 1024, got 1025"),
    ],
)
def test_lora_numbers_outside_their_range_exit_2_naming_the_flag_or_variable(
    clean_env, dirs, capsys, flag, value, message
):
    argv = ["serve", "--model", "m", "--checkpoint-path", str(dirs["ckpt"]), "--lora"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, flag, value])
    assert exc.value.code == 2 and f"argument {flag}: must be a finite number {message}" in capsys.readouterr().err
    clean_env.setenv(env_name(flag), value)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert (
        exc.value.code == 2
        and f"environment variable {env_name(flag)}={value!r} is not valid" in capsys.readouterr().err
    )


def test_lora_numbers_declare_their_ranges_and_the_dataclass_checks_them():
    spans = {f.name: declared_bounds(f) for f in dataclasses.fields(LoraServing)}
    assert spans["max_rank"] == (1, 4096) and spans["max_loras_per_batch"] == (2, 1024)
    assert LoraServing(max_rank=4096, max_loras_per_batch=1024).max_loras_per_batch == 1024
    with pytest.raises(ValueError, match="^--max-loras-per-batch must be a finite number from 2 to 1024"):
        LoraServing(max_loras_per_batch=1025)
    with pytest.raises(ValueError, match="^--max-lora-rank must be a finite number from 1 to 4096"):
        LoraServing(max_rank=0)


def test_every_number_setting_of_every_settings_class_declares_a_range():
    from rollout_service.sglang_launcher import SGLangServerConfig

    for cls in (SidecarSettings, RestartPolicy, LoraServing, SGLangServerConfig):
        hints = typing.get_type_hints(cls)
        for f, declaration in declared_settings(cls):
            kinds = set(typing.get_args(hints[f.name]) or (hints[f.name],))
            if kinds & {int, float}:
                assert declared_bounds(f) is not None, f"{cls.__name__}.{f.name} ({declaration.flag}) has no range"
