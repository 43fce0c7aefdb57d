"""Choosing, from measured times, whether a delta or a full publish is the faster sync here.

A delta saves storage bytes but costs CPU: the trainer XORs and compresses every tensor
(0.3-0.9 GB/s on two shared cores, ``docs/benchmarks.md`` §4e) and every sidecar rebuilds the
full checkpoint from it at about the same rate. On a network file system (0.1-0.2 GB/s) that
is 3-5x faster end to end than moving the whole model; on tmpfs or a fast local disk
(1.5-2.6 GB/s) it is 1.3-3x *slower*. Which one wins depends on the storage and the hosts, so
:class:`PublishCosts` measures it instead of guessing:

- every publish reports its trainer-side time (taking the weights in + writing) per byte of
  the full checkpoint, by kind; each kind keeps a moving average;
- a delta is published while its average is not above the full one's (the sidecar's side of
  each path mirrors the trainer's: a full step is read back at the storage's rate, a delta is
  rebuilt at the encode's rate, so the trainer's comparison decides both);
- while full publishes are faster, a delta is tried again every ``probe_every`` versions (one
  delta, then ``probe_every - 1`` full ones), so a change (a slower mount, a busier host) is
  noticed. A delta that had to be written in full after all (too large, its base gone) counts
  as a delta, at what it cost: the encode was paid for nothing.

Until both kinds have been measured at least once, deltas are chosen (the writer's first
publish is full anyway, and its second is the first delta: the comparison starts at the third).
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.5
"""Weight of the newest measurement in each kind's moving average."""


@dataclass(frozen=True)
class Choice:
    delta: bool
    reason: str = ""
    """Why a full publish was chosen (empty for a delta)."""
    probe: bool = False
    """A delta only to measure deltas again (full publishes were faster so far)."""


class PublishCosts:
    """Moving averages of publish seconds per GB, by kind, and the choice they imply."""

    def __init__(self, probe_every: int):
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every}")
        self.probe_every = probe_every
        self.s_per_gb: dict[str, float] = {}
        self._since_delta = 0
        """Versions published since the last delta (the probe counter)."""

    def observe(self, kind: str, seconds: float, full_bytes: int) -> None:
        """Record one publish of ``kind`` (``full`` or ``delta``) that took ``seconds`` for a
        checkpoint of ``full_bytes`` (its full size, whichever kind was written)."""
        if kind not in ("full", "delta") or full_bytes <= 0 or seconds < 0:
            return
        value = seconds / (full_bytes / 1e9)
        old = self.s_per_gb.get(kind)
        self.s_per_gb[kind] = value if old is None else SMOOTHING * value + (1 - SMOOTHING) * old
        self._since_delta = 0 if kind == "delta" else self._since_delta + 1

    def choose(self) -> Choice:
        """Whether the next version should be a delta, and if not, why."""
        full, delta = self.s_per_gb.get("full"), self.s_per_gb.get("delta")
        if full is None or delta is None or delta <= full:
            return Choice(True)
        if self._since_delta >= self.probe_every - 1:
            return Choice(True, probe=True)  # measure deltas again
        return Choice(
            False,
            f"full publishes are faster on this storage ({full:.2f} s/GB against {delta:.2f} s/GB for"
            f" deltas, measured; deltas are tried again every {self.probe_every} versions;"
            " checkpoint_delta=True forces them)",
        )
