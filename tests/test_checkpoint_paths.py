"""Paths are confined to the checkpoint root without looking outside it: ``resolve_inside`` and
``is_inside`` agree with ``os.path.realpath`` for every path that stays in the root (links,
``..``, a root that is itself reached through a link), and refuse a link out of the root, a loop
of links, or ``..`` past the root, without following them (a link to a hung mount would block
the look for good: tests/test_sync_loop_hazards.py shows that on a frozen sshfs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout_service.checkpoint_format import CheckpointError
from rollout_service.checkpoint_paths import is_inside, resolve_inside


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    os.symlink("a", root / "to-a")
    os.symlink("../root/a", root / "around-to-a")
    os.symlink(str(tmp_path / "out"), root / "to-out")
    os.symlink("loop", root / "loop")
    os.symlink("../escape", root / "a" / "up")  # root/escape: still inside
    os.symlink("../../out", root / "a" / "up-twice")
    os.symlink(str(root), tmp_path / "root-link")
    return root


INSIDE = [
    "a",
    "to-a",
    "to-a/x",
    "around-to-a",
    "a/../a",
    "a/up",
    "a/up/../a",
    "to-a/../to-a/./x",
    ".",
    "a/../../root/a",
]
OUTSIDE = ["to-out", "to-out/x", "loop", "../out", "a/up-twice", "a/up-twice/../root", "/", ".."]


@pytest.mark.parametrize("candidate", INSIDE)
def test_a_path_that_stays_in_the_root_resolves_as_realpath_does(tree: Path, candidate: str) -> None:
    assert resolve_inside(tree, candidate) == Path(os.path.realpath(tree / candidate))
    assert is_inside(tree / candidate, tree)


@pytest.mark.parametrize("candidate", OUTSIDE)
def test_a_path_that_leaves_the_root_is_refused(tree: Path, candidate: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        resolve_inside(tree, candidate)
    assert refused.value.reason == "path_escape"
    assert not is_inside(tree / candidate, tree)


def test_the_root_may_be_reached_through_a_link_and_relative_paths_are_the_working_directorys(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    via_link = tree.parent / "root-link"
    assert resolve_inside(via_link, "to-a") == tree / "a"
    assert is_inside(via_link / "a", tree) and is_inside(tree / "a", via_link)
    monkeypatch.chdir(tree.parent)
    assert is_inside("root/a", tree) and not is_inside("a", tree)
    assert resolve_inside(Path("root"), "to-a") == tree / "a"
