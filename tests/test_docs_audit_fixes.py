"""Fixes from an audit of the docs against the code (session 26); each test names what was wrong.

The delta format's doc gave frames from 4 KiB (readers refuse under 1 MiB); ``demo --device``
took any word and passed it on; the README's script list missed four benchmark scripts and
named ``run_all.sh``'s output folder wrongly; the README gave ``replica_heartbeat_max_age`` the
other timeouts' 0.01 s floor; the multi-node text told a trainer facing several replicas to wait
through the Service's one; ``materialize --help`` hid ``manifest.json`` and its exit codes.
None of them starts SGLang.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollout_service import checkpoint_format
from rollout_service.cli import build_parser
from rollout_service.protocol import MIN_HEARTBEAT_MAX_AGE_S

REPO = Path(__file__).resolve().parent.parent


def _mib(number: str, unit: str) -> int:
    return int(number) << {"KiB": 10, "MiB": 20, "GiB": 30}[unit]


def test_the_delta_docs_give_the_frame_sizes_readers_take() -> None:
    text = (REPO / "docs" / "delta-sync.md").read_text()
    found = re.search(r"a power of two, (\d+) (KiB|MiB) to (\d+) (KiB|MiB)", text)
    assert found, "docs/delta-sync.md no longer states the frame size range"
    low, high = _mib(*found.group(1, 2)), _mib(*found.group(3, 4))
    assert (low, high) == (checkpoint_format.MIN_FRAME_BYTES, checkpoint_format.MAX_FRAME_BYTES)


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_demo_refuses_a_device_it_does_not_run_on(capsys, monkeypatch, how: str) -> None:
    """Before, ``--device gpu`` (or ``ROLLOUT_DEVICE=gpu``) was passed to the trainer and `serve`."""
    from rollout_demo.cli import build_parser as demo_parser

    argv = ["demo"]
    if how == "flag":
        argv += ["--device", "gpu"]
    else:
        monkeypatch.setenv("ROLLOUT_DEVICE", "gpu")
    with pytest.raises(SystemExit) as exc:
        demo_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'gpu' is not a device the demo runs on: use 'cpu' or 'cuda'" in err


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_demo_takes_the_devices_it_runs_on(monkeypatch, device: str) -> None:
    from rollout_demo.cli import build_parser as demo_parser

    monkeypatch.delenv("ROLLOUT_DEVICE", raising=False)
    assert demo_parser().parse_args(["demo", "--device", device]).device == device


def test_the_readme_names_every_benchmark_script_and_where_run_all_writes() -> None:
    readme = (REPO / "README.md").read_text()
    scripts = sorted(
        p.name
        for p in (REPO / "benchmarks").iterdir()
        if p.suffix in (".py", ".sh") and p.name not in ("measures.py", "model_factory.py")
    )
    missing = [name for name in scripts if not re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", readme)]
    assert not missing, f"README.md's Benchmarks section does not name {missing}"
    run_all = (REPO / "benchmarks" / "run_all.sh").read_text()
    plots = re.search(r"plot_sync\.py \S+ --out (\S+)", run_all)
    assert plots, "run_all.sh no longer plots with --out"
    assert f"into `{plots.group(1)}/`" in readme


def test_the_readme_gives_each_timeout_its_own_floor() -> None:
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"`replica_heartbeat_max_age` from {MIN_HEARTBEAT_MAX_AGE_S:g} s" in readme
    assert "the three timeouts from 0.01 s" not in readme


def test_the_multi_node_docs_wait_for_every_replica() -> None:
    deploy = " ".join((REPO / "docs" / "deploy.md").read_text().split())
    section = deploy.split("## Multi-node training with accelerate", 1)[1].split("\n## ", 1)[0]
    assert "`--expected-replicas N` equal to the replica count" in section
    overlay = (REPO / "deploy" / "k8s" / "overlays" / "gpu" / "trainer-job.yaml").read_text()
    assert "--expected-replicas" in overlay  # what the text points to is what the overlay does


def test_materialize_help_names_the_manifest_and_the_exit_codes() -> None:
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    text = " ".join(sub.choices["materialize"].format_help().split())
    assert "manifest.json" in text
    assert "Exit status: 0 done" in text and "1 the step cannot be rebuilt" in text
