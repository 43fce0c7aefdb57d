"""Paths found under the checkpoint root are confined to it without looking outside it:
``resolve_inside`` agrees with ``os.path.realpath`` for every path that stays in the root (links,
``..``, a root that is itself reached through a link, a link's absolute target written through
that link), and refuses a link out of the root (also one that comes back), a loop of links, or
``..`` past the root or after a missing folder, without following them (a link to a hung mount
would block the look for good: tests/test_sync_loop_hazards.py shows that on a frozen sshfs).
``is_inside``, for paths callers give, is ``realpath``'s answer."""

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
    os.symlink(str(tmp_path / "root-link" / "a"), root / "via-root-link")  # into the root, through its link
    os.symlink(str(tmp_path / "back"), root / "out-and-back")
    os.symlink(str(root / "a"), tmp_path / "back")
    return root


INSIDE = [
    "a",
    "to-a",
    "to-a/x",
    "around-to-a",
    "a/../a",
    "a/up",
    "to-a/../to-a/./x",
    ".",
    "a/../../root/a",
    "a/missing/x",
]
OUTSIDE = ["to-out", "to-out/x", "loop", "../out", "a/up-twice", "a/up-twice/../root", "/", ".."]
REFUSED_THOUGH_INSIDE = ["out-and-back", "a/missing/../up", "a/up/../a", "via-root-link"]
"""Paths realpath puts in the root, refused all the same: a link that leaves the root is not
followed even when it comes back, and ``..`` after a folder that is not there is where the
kernel fails (a look past it could follow a link out). A link through another name of the root
counts as leaving it, unless that name is the root as configured (the next test)."""


@pytest.mark.parametrize("candidate", INSIDE)
def test_a_path_that_stays_in_the_root_resolves_as_realpath_does(tree: Path, candidate: str) -> None:
    assert resolve_inside(tree, candidate) == Path(os.path.realpath(tree / candidate))


@pytest.mark.parametrize("candidate", OUTSIDE + REFUSED_THOUGH_INSIDE)
def test_a_path_that_leaves_the_root_is_refused(tree: Path, candidate: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        resolve_inside(tree, candidate)
    assert refused.value.reason == "path_escape"


def test_a_missing_folder_then_dotdot_cannot_lead_to_a_link_out_of_the_root(tree: Path) -> None:
    """realpath goes on after a missing folder and follows the link it meets next."""
    with pytest.raises(CheckpointError, match="outside the checkpoint root"):
        resolve_inside(tree, "a/missing/../up-twice")


def test_is_inside_is_realpaths_answer(tree: Path) -> None:
    for candidate in INSIDE + REFUSED_THOUGH_INSIDE:
        assert is_inside(tree / candidate, tree), candidate
    for candidate in ["to-out", "to-out/x", "../out", "a/up-twice"]:
        assert not is_inside(tree / candidate, tree), candidate


def test_the_root_may_be_reached_through_a_link_and_relative_paths_are_the_working_directorys(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    via_link = tree.parent / "root-link"
    assert resolve_inside(via_link, "to-a") == tree / "a"
    assert resolve_inside(via_link, "via-root-link") == tree / "a"  # an absolute target through it
    assert is_inside(via_link / "a", tree) and is_inside(tree / "a", via_link)
    monkeypatch.chdir(tree.parent)
    assert is_inside("root/a", tree) and not is_inside("a", tree)
    assert resolve_inside(Path("root"), "to-a") == tree / "a"
