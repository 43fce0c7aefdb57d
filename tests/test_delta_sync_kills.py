"""A real sidecar beside a real SGLang server, SIGKILLed at moments spread over delta syncs: SGLang
only ever serves a whole published version, and a restarted sidecar on the same stage recovers.

`test_delta_checkpoints.py` kills `Stage.build` itself at random moments of an apply (20 trials, no
server); this file kills the whole sidecar process group anywhere in a sync (detection, validation,
the apply in the stage, the load call) while SGLang keeps serving, and checks what SGLang serves.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from delta_helpers import as_published, publish_chain
from helpers import generate
from sidecar_helpers import transformers_greedy, transformers_logprobs

PROMPT = [11, 42, 7, 99, 256, 3]
NEW_TOKENS = 8
MIN_TRIALS = 10
MAX_TRIALS = 24
EXTRA_TRIALS_S = 180.0
"""Trials past MIN_TRIALS start only this long after the first (a bound on the test's time)."""
LOGPROB_TOLERANCE = 2e-3
"""As in test_delta_sync: SGLang's bf16 CPU forward against transformers' float32 one."""


class Versions:
    """What each published step must serve: greedy ids and their logprobs, from transformers."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.states: dict[int, dict] = {}
        self._expected: dict[int, tuple[list[int], list[float]]] = {}

    def expected(self, step: int) -> tuple[list[int], list[float]]:
        if step not in self._expected:
            state = as_published(self.states[step])
            ids = transformers_greedy(self.model_dir, state, PROMPT, NEW_TOKENS)
            self._expected[step] = (ids, transformers_logprobs(self.model_dir, state, PROMPT, ids))
        return self._expected[step]

    def served_by(self, url: str) -> int:
        """The step SGLang serves, checked against that step's weights: its greedy ids and their
        logprobs equal a transformers forward over what the trainer published for it."""
        out = generate(url, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)
        step = int(out["meta_info"]["weight_version"])
        ids, logprobs = self.expected(step)
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert out["output_ids"] == ids, f"SGLang's output under version {step} is not that version's"
        gap = max(abs(a - b) for a, b in zip(ours, logprobs))
        assert gap < LOGPROB_TOLERANCE, f"SGLang's logprobs under version {step} are {gap:.2e} off that version's"
        return step


def _stage_entries(stage: Path) -> list[str]:
    return sorted(p.name for p in stage.iterdir())


def test_a_sidecar_killed_anywhere_in_delta_syncs_never_lets_sglang_serve_a_half_applied_copy(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    stage = tmp_path / "stage-r0"
    versions = Versions(tiny_model_dir)
    sidecar = sidecar_factory("--stage-dir", str(stage), replica_id="r0")
    writer, states = publish_chain(checkpoint_root, tiny_model_dir, range(1, 3))
    versions.states.update(states)
    sidecar.wait_step(2)
    # The window a kill can land in: from a delta's publication to its step being served.
    started = time.monotonic()
    _, states = publish_chain(checkpoint_root, tiny_model_dir, range(3, 4), writer=writer)
    versions.states.update(states)
    assert sidecar.wait_step(3)["last_sync"]["kind"] == "delta"
    window = time.monotonic() - started
    assert versions.served_by(sglang_server.url) == 3
    sidecar.wait_stage_bytes()  # the stage is pruned after the load is answered, then measured
    steady = _stage_entries(stage)
    # The check can tell consecutive versions apart: a copy mixing two versions' tensors would not
    # pass as either (the logprobs of one version's completion differ by far more than the tolerance).
    ids3, lp3 = versions.expected(3)
    ids2, lp2 = versions.expected(2)
    assert ids2 != ids3 or max(abs(a - b) for a, b in zip(lp2, lp3)) > 10 * LOGPROB_TOLERANCE

    # Kill moments spread evenly from the publication to past the window's end (MIN_TRIALS),
    # then random ones over three windows until kills landed on both sides of the load (a slow
    # machine stretches the window the first sync measured).
    moments = [window * 1.2 * i / (MIN_TRIALS - 1) for i in range(MIN_TRIALS)]
    rng = random.Random(20261204)
    before_load = after_load = 0
    step = 3
    budget = time.monotonic() + EXTRA_TRIALS_S
    while step - 3 < MIN_TRIALS or (
        min(before_load, after_load) < 2 and step - 3 < MAX_TRIALS and time.monotonic() < budget
    ):
        step += 1
        _, states = publish_chain(checkpoint_root, tiny_model_dir, range(step, step + 1), writer=writer)
        versions.states.update(states)
        moment = moments[step - 4] if step - 4 < MIN_TRIALS else rng.uniform(0.0, window * 3)
        time.sleep(moment)
        sidecar.kill()
        # Whatever the moment, SGLang serves a whole version: the one before, or this one.
        served = versions.served_by(sglang_server.url)
        assert served in (step - 1, step), f"trial {step}: SGLang serves version {served}"
        before_load += served == step - 1
        after_load += served == step
        # A sidecar restarted on the same stage brings SGLang to this step: it adopts what SGLang
        # serves, and when SGLang does not serve it yet, loads the copy the killed sidecar had
        # finished (chain 0) or applies the step as one delta on the staged copy (chain 1); the
        # chain is never replayed from the full step.
        sidecar = sidecar_factory("--stage-dir", str(stage), replica_id="r0")
        status = sidecar.wait_step(step)
        assert status["loaded_step"] == step, status
        assert versions.served_by(sglang_server.url) == step
        if status["last_sync"] is not None:  # None: SGLang had the step already (a load in flight)
            assert status["last_sync"]["kind"] == "delta", status["last_sync"]
            assert status["last_sync"]["chain_length"] in (0, 1), status["last_sync"]
    # The kills landed on both sides of the load, and none left litter in the stage.
    assert before_load >= 1 and after_load >= 1, (before_load, after_load, window)
    deadline = time.monotonic() + 30
    while len(_stage_entries(stage)) > len(steady):
        assert time.monotonic() < deadline, f"the stage kept {_stage_entries(stage)} (steady: {steady})"
        time.sleep(0.2)
