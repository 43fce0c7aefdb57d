"""Fixes from a review of the CLI against its docs; each test names what went wrong before.

``validate --reference`` refused a bf16 step of an fp32 model the sidecar loads; ``serve``
dropped the LoRA flags without ``--lora`` unseen and took ``--no-stage`` with ``--stage-dir``;
a missing ``--reference-dir`` passed the settings; ``publish --dtype float64`` was published
though the trainer refuses it; argparse swallowed why ``--lora-target-modules ,`` was refused;
a port clash from ``ROLLOUT_PORT`` named only the flags; ``--log-level`` had no variable and
worked before the command only; errors showed ``[Errno N]`` and hidden work folders; several
number flags hid their ranges; a delta writer on a relative root wrote every step in full; and
the docs named a flag that does not exist and a head timeout the sidecar was said not to have.
None of them starts SGLang.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from delta_helpers import CONFIG, RUN, Model
from rollout_service import cli
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.cli import build_parser, main
from rollout_service.cli_env import ENV_PREFIX
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.lora_serving import LoraServing, lora_from_args
from rollout_service.protocol import ACK_INTERVAL_S
from rollout_service.publish_dtypes import PUBLISHABLE_DTYPES
from rollout_service.sidecar.request_heads import REQUEST_HEAD_TIMEOUT_S
from rollout_service.sidecar.settings import SidecarSettings

REPO = Path(__file__).resolve().parent.parent
THREAT_MODEL = REPO / "docs" / "threat-model.md"


@pytest.fixture(autouse=True)
def no_rollout_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``ROLLOUT_*`` variable of the machine running the tests changes a command line here."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def no_serve(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``serve`` with `run_serve` replaced by a recorder: nothing started; what it would start."""
    seen: dict = {}

    def recorder(server, settings, policy, listeners):
        for sock in listeners:
            sock.close()
        seen["server"], seen["settings"] = server, settings
        return 0

    monkeypatch.setattr(cli, "run_serve", recorder)
    return seen


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``rollout-service ARGV`` in-process: its exit code (argparse's too) and its stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def serve(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, str]:
    return run(capsys, "serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path / "root"), *argv)


def subparser(command: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("no subcommands")


def help_of(command: str, flag: str) -> str:
    (action,) = [a for a in subparser(command)._actions if flag in a.option_strings]
    return " ".join((action.help or "").split())


# ---------------------------------------------------- 1. validate takes the dtypes the sidecar loads


def test_validate_passes_a_bf16_step_of_an_fp32_model_as_the_sidecar_does(capsys, tmp_path: Path) -> None:
    weights = {"a.weight": torch.randn(4, 8), "b.weight": torch.randn(8)}
    reference = tmp_path / "model"
    reference.mkdir()
    save_file(weights, str(reference / "model.safetensors"))
    (reference / "config.json").write_text(json.dumps(CONFIG))
    step = publish_checkpoint(tmp_path / "root", 1, weights.items(), config=CONFIG, dtype="bfloat16").path
    rc, err = run(capsys, "validate", str(step), "--reference", str(reference))
    assert rc == 0, err
    rc, err = run(capsys, "validate", str(step), "--reference", str(reference), "--exact-dtypes")
    assert rc == 1 and err.startswith("INVALID (dtype_mismatch): ") and "BF16" in err, err
    assert run(capsys, "validate", str(step), "--reference", str(reference), "--allow-float-cast")[0] == 0


# ----------------------------------------------------------------------- 2. --check-digests' help


def test_check_digests_help_says_it_works_only_without_the_stage() -> None:
    for command in ("serve", "sidecar"):
        text = help_of(command, "--check-digests")
        assert "with --no-stage only" in text and "staging (the default) checks every byte" in text, text


# -------------------------------------------------------------- 3. LoRA flags need --lora


@pytest.mark.parametrize(
    "argv, env, named",
    [
        (["--max-lora-rank", "8"], {}, "--max-lora-rank is only used with --lora"),
        (["--lora-target-modules", "q_proj"], {}, "--lora-target-modules is only used with --lora"),
        ([], {"ROLLOUT_LORA_BACKEND": "triton"}, "ROLLOUT_LORA_BACKEND is only used with --lora"),
        (["--max-loras-per-batch", "3"], {"ROLLOUT_LORA": "0"}, "--max-loras-per-batch is only used with --lora"),
    ],
)
def test_serve_refuses_lora_settings_without_lora(
    capsys, tmp_path: Path, no_rollout_env, no_serve, argv, env, named
) -> None:
    for name, value in env.items():
        no_rollout_env.setenv(name, value)
    rc, err = serve(capsys, tmp_path, "--device", "cpu", *argv)
    assert rc == 2 and not no_serve and named in err and "add --lora (or ROLLOUT_LORA=1)" in err, err
    assert not (tmp_path / "root").exists()  # refused before anything was made


def test_lora_settings_with_lora_are_taken_and_their_help_says_so(no_rollout_env) -> None:
    no_rollout_env.setenv("ROLLOUT_LORA", "1")
    args = build_parser().parse_args(["serve", "--model", "m", "--checkpoint-path", "c", "--max-lora-rank", "8"])
    assert lora_from_args(args) == LoraServing(max_rank=8)
    for flag in ("--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch", "--lora-backend"):
        assert help_of("serve", flag).startswith("(with --lora) "), flag


# ------------------------------------------------------------------------- 4, 5. the threat model


def test_the_threat_model_names_only_flags_that_exist() -> None:
    flags = {flag for sub in _subparsers().values() for a in sub._actions for flag in a.option_strings}
    sglangs = {"--api-key"}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", THREAT_MODEL.read_text()))
    assert named - flags - sglangs == set()


def test_the_docs_give_the_ack_interval_and_the_request_head_timeout_the_code_has() -> None:
    text = " ".join(THREAT_MODEL.read_text().split())
    assert f"every {ACK_INTERVAL_S:g} s (`ACK_INTERVAL_S`" in text
    head = f"no complete request head within {REQUEST_HEAD_TIMEOUT_S:g} s of opening, or of its last answer, is closed"
    assert head in text and "sends no head at all still holds it" not in text
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"sends no request head within {REQUEST_HEAD_TIMEOUT_S:g} s of opening or of its last answer is closed" in (
        readme
    )


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


# ------------------------------------------------------------------------- 6. --reference-dir


def test_a_reference_dir_that_is_no_directory_is_refused_by_the_settings(capsys, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for reference in (tmp_path / "missing", a_file):
        with pytest.raises(ValueError, match=rf"^--reference-dir {re.escape(str(reference))} is not a directory"):
            SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", reference_dir=reference)
    rc, err = run(
        capsys,
        "sidecar",
        "--checkpoint-path",
        str(root),
        "--sglang-url",
        "http://127.0.0.1:9",
        "--reference-dir",
        "nope",
    )
    assert rc == 2 and f"error: --reference-dir {Path('nope').absolute()} is not a directory" in err, err
    fine = SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", reference_dir=tmp_path)
    assert fine.reference_dir == tmp_path


# ---------------------------------------------------------------- 7. --no-stage with --stage-dir


def test_no_stage_with_a_stage_dir_is_refused(capsys, tmp_path: Path, no_rollout_env) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ValueError, match="^--no-stage and --stage-dir .* are both given"):
        SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", stage=False, stage_dir=tmp_path / "st")
    no_rollout_env.setenv("ROLLOUT_NO_STAGE", "1")
    argv = ["sidecar", "--checkpoint-path", str(root), "--sglang-url", "http://127.0.0.1:9"]
    rc, err = run(capsys, *argv, "--stage-dir", str(tmp_path / "st"))
    assert rc == 2 and "--no-stage and --stage-dir" in err and "ROLLOUT_NO_STAGE" in err, err
    assert SidecarSettings(checkpoint_path=root, sglang_url="http://127.0.0.1:9", stage=False).stage_dir is None


# ----------------------------------------------------------- 8. the publishable dtypes, defined once


def test_publish_takes_the_dtypes_the_trainer_publishes_and_no_other(capsys, tmp_path: Path) -> None:
    from trainer_hooks import checkpoint_dtype

    model = tmp_path / "model"
    model.mkdir()
    save_file({"a.weight": torch.randn(4, 8)}, str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps(CONFIG))
    root = tmp_path / "root"
    argv = ["publish", "--model-dir", str(model), "--checkpoint-path", str(root)]
    for dtype in ("float64", "F8_E4M3", "int8"):
        rc, err = run(capsys, *argv, "--step", "1", "--dtype", dtype)
        assert rc == 2 and f"argument --dtype: {dtype!r} is not a dtype checkpoints can be published in" in err
        assert "use one of bfloat16, float16, float32" in err
        with pytest.raises(ValueError, match=rf"checkpoint_dtype='{dtype}' is not a dtype"):
            checkpoint_dtype.publishable_dtype(dtype)
    assert not root.exists()
    assert all(name in help_of("publish", "--dtype") for name in PUBLISHABLE_DTYPES)
    assert run(capsys, *argv, "--step", "1", "--dtype", "bf16")[0] == 0
    assert Manifest.load(root / step_dir_name(1)).dtype == "BF16"
    assert checkpoint_dtype.PUBLISHABLE_DTYPES is PUBLISHABLE_DTYPES  # one definition for both


# ----------------------------------------------------------- 9. --lora-target-modules says why


def test_an_empty_module_list_is_refused_saying_why(capsys, tmp_path: Path) -> None:
    rc, err = serve(capsys, tmp_path, "--lora", "--lora-target-modules", ",")
    assert rc == 2 and "argument --lora-target-modules: no module name in ','" in err, err
    rc, err = run(capsys, "validate", str(tmp_path), "--lora-target-modules", " ")
    assert rc == 2 and "no module name in ' '" in err, err


# ------------------------------------------------------- 10. a port clash names where each came from


def test_a_port_clash_names_the_variable_it_came_from(capsys, tmp_path: Path, no_rollout_env, no_serve) -> None:
    no_rollout_env.setenv("ROLLOUT_PORT", "8100")
    rc, err = serve(capsys, tmp_path, "--device", "cpu")
    assert rc == 2 and not no_serve, err
    assert "--port and --sidecar-port are both 8100 (--port from ROLLOUT_PORT, --sidecar-port by default)" in err
    rc, err = serve(capsys, tmp_path, "--device", "cpu", "--sidecar-port", "8100")
    assert "(--port from ROLLOUT_PORT, --sidecar-port given)" in err, err


# ------------------------------------------------------------------------- 11. --log-level


def test_log_level_is_taken_after_the_command_and_from_its_variable(capsys, no_rollout_env) -> None:
    parse = build_parser().parse_args
    assert parse(["liveness"]).log_level == "INFO"
    assert parse(["liveness", "--log-level", "warn"]).log_level == "WARNING"
    no_rollout_env.setenv("ROLLOUT_LOG_LEVEL", "debug")
    assert parse(["liveness"]).log_level == "DEBUG"
    assert parse(["--log-level", "error", "liveness"]).log_level == "ERROR"  # a flag wins over the variable
    assert parse(["--log-level", "error", "liveness", "--log-level", "critical"]).log_level == "CRITICAL"
    assert "[env ROLLOUT_LOG_LEVEL; default INFO]" in help_of("serve", "--log-level")
    no_rollout_env.setenv("ROLLOUT_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit):
        parse(["sidecar", "--checkpoint-path", "c", "--sglang-url", "http://127.0.0.1:9"])
    assert "environment variable ROLLOUT_LOG_LEVEL='loud' is not valid for --log-level" in capsys.readouterr().err


# -------------------------------------------------------------- 13. errors name the flag, not errno


def test_publish_into_a_file_names_checkpoint_path_without_an_errno(capsys, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"a.weight": torch.randn(4, 8)}, str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps(CONFIG))
    into = tmp_path / "a-file"  # outside the model: a root inside --model-dir is refused before any write
    into.write_text("not a folder")
    rc, err = run(capsys, "publish", "--model-dir", str(model), "--checkpoint-path", str(into), "--step", "1")
    assert rc == 2 and err.startswith(f"error: cannot write --checkpoint-path {into}: File exists"), err
    assert "[Errno" not in err


def test_make_tiny_model_names_out_and_not_its_hidden_work_folder(capsys, tmp_path: Path) -> None:
    out = Path("/proc") / f"rollout-test-{os.getpid()}"  # no folder can be made in /proc
    rc, err = run(capsys, "make-tiny-model", "--out", str(out))
    assert rc == 2 and err.startswith(f"error: cannot write --out {out}: "), err
    assert ".building" not in err and "[Errno" not in err


def test_validate_names_a_missing_reference_as_the_readme_says(capsys, tmp_path: Path) -> None:
    rc, err = run(capsys, "validate", str(tmp_path), "--reference", str(tmp_path / "missing"))
    assert rc == 2 and err.startswith(f"error: cannot read --reference {tmp_path / 'missing'}: "), err
    assert "does not exist" in err and "[Errno" not in err
    readme = (REPO / "README.md").read_text()
    assert "exits 2 with `error: cannot read --reference DIR: <why>`" in readme


# ------------------------------------------------------------------ 14. every number flag's range


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_help_shows_the_range_of_every_number_flag(command: str) -> None:
    for action in _subparsers()[command]._actions:
        span = _range_of(action.type)
        if span is not None:
            assert span in " ".join((action.help or "").split()), (command, action.option_strings, span)


def _range_of(convert: object) -> str | None:
    """``0.01 to 604800`` when ``convert`` refuses numbers outside a range (``number_type``)."""
    if not callable(convert):
        return None
    for text in ("1e300", "9" * 30, "-" + "9" * 30):
        try:
            convert(text)
        except argparse.ArgumentTypeError as exc:
            found = re.search(r"must be a finite number from (\S+ to \S+),", str(exc))
            if found:
                return found.group(1)
        except (TypeError, ValueError):
            continue
    return None


# ------------------------------------------------------------- 15. the sidecar's settings in the docs


def test_deploy_docs_and_the_threat_model_name_the_health_and_finite_settings() -> None:
    deploy = (REPO / "docs" / "deploy.md").read_text()
    for name in ("ROLLOUT_DEEP_HEALTH_INTERVAL", "ROLLOUT_NO_CHECK_FINITE", "--deep-health-interval"):
        assert name in deploy, name
    threat = " ".join(THREAT_MODEL.read_text().split())
    assert "`--no-check-finite` turns the NaN/Inf check off" in threat


# ---------------------------------------------------------- 16. a delta writer on a relative root


def test_a_delta_writer_on_a_relative_root_writes_deltas(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, writer = Model(lr=1e-6), DeltaCheckpointWriter(full_every=10)
    kinds = []
    for step in (1, 2, 3):
        result = writer.publish("root", step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
        kinds.append(result.kind)
        model.step()
    assert kinds == ["full", "delta", "delta"], writer.last
    assert Manifest.load(tmp_path / "root" / step_dir_name(3)).delta is not None
