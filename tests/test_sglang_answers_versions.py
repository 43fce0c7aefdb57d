"""Weight versions the staleness bound refuses: older than it allows, newer than this run published
(another run's checkpoint), missing, or not a version string. Each is retried until sync_timeout,
then named for what it is: an older version (or SGLang's start-up "default") is blamed on a replica
that does not load checkpoints, the others are not.

These drive the real `StaleRetryPolicy` and `SGLangEndpoints` against `fake_sglang.CannedServer`: a
real SGLang server started by rollout-service labels its answers with the version its sidecar
loaded last and catches up before sync_timeout, so an answer that stays older than required,
another run's label, a missing field or a float cannot be had from it on demand.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import trainer_hooks.stale_retry as stale_retry
from fake_sglang import CannedServer, canned_answer, canned_reply
from trainer_hooks.sglang_endpoints import SGLangEndpoints
from trainer_hooks.sglang_responses import parse_weight_version
from trainer_hooks.stale_retry import StaleRetryPolicy, StaleWeightsError

MISSING = object()


class Published:
    """The trainer published versions 1 .. 5 (max_staleness 0: version 5 is required)."""

    latest_version = 5
    first_version = 1

    def version_back(self, publishes: int) -> int:
        return max(self.latest_version - publishes, self.first_version)

    def raise_if_failed(self) -> None:
        pass


class NoWait:
    def wait(self, version: int, timeout_s: float) -> None:
        pass


@pytest.fixture
def labelled() -> Iterator[Any]:
    """``labelled(version)``: a policy over a canned server whose answers carry ``version``
    (``MISSING``: no weight_version at all)."""
    made: list[tuple[CannedServer, SGLangEndpoints]] = []

    def make(version: Any) -> tuple[StaleRetryPolicy, CannedServer]:
        def handler(path: str, body: Any, count: int) -> Any:
            if path != "/generate":
                return None
            answer = canned_answer(body, version=version)
            if version is MISSING:
                for item in answer:
                    del item["meta_info"]["weight_version"]
            return canned_reply(200, answer)

        server = CannedServer(handler)
        endpoints = SGLangEndpoints([server.url], request_timeout_s=10, vocab_size=100)
        made.append((server, endpoints))
        policy = StaleRetryPolicy(endpoints, Published(), NoWait(), max_staleness=0, sync_timeout_s=0.6)
        return policy, server

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stale_retry, "STALE_RETRY_PAUSE_S", 0.05)
        yield make
    for server, endpoints in made:
        endpoints.close()
        server.stop()


def run(policy: StaleRetryPolicy) -> Any:
    return policy.generate([[1, 2]], {"n": 2, "max_new_tokens": 4}, want_logprobs=True, rescore=False)


@pytest.mark.parametrize("version", ["5", 5])
def test_the_published_version_is_accepted(labelled: Any, version: Any) -> None:
    policy, server = labelled(version)
    groups, record = run(policy)
    assert record.versions == [5, 5] and record.stale_retries == 0
    assert len(server.generate_requests) == 1


@pytest.mark.parametrize("version", ["6", "99999999", 99999999])
def test_a_version_newer_than_this_run_published_is_another_runs_and_refused(labelled: Any, version: Any) -> None:
    policy, server = labelled(version)
    with pytest.raises(StaleWeightsError) as caught:
        run(policy)
    message = str(caught.value)
    assert (
        f"weights of version(s) ['{version}'], newer than any version this run published (the newest is 5)" in message
    )
    assert "another run's checkpoint" in message and "not loading checkpoints" not in message
    assert len(server.generate_requests) >= 2  # retried until sync_timeout


def test_a_missing_weight_version_is_named_not_blamed_on_checkpoint_loading(labelled: Any) -> None:
    policy, _ = labelled(MISSING)
    with pytest.raises(StaleWeightsError) as caught:
        run(policy)
    message = str(caught.value)
    assert "no meta_info.weight_version at all: SGLang too old to report it" in message
    assert "not started by `rollout-service serve`" in message
    assert "not loading checkpoints" not in message


@pytest.mark.parametrize(
    "version, shown",
    [
        (5.0, "5.0"),
        ("5.0", "5.0"),
        (True, "True"),
        ([5], "[5]"),
        ("\uff10\uff15", "\uff10\uff15"),
        (10**8, "100000000"),
    ],
    ids=["float", "float-string", "bool", "list", "fullwidth-digits", "int-beyond-max-step"],
)
def test_a_weight_version_that_is_not_a_version_string_is_named(labelled: Any, version: Any, shown: str) -> None:
    policy, _ = labelled(version)
    with pytest.raises(StaleWeightsError) as caught:
        run(policy)
    message = str(caught.value)
    assert f"a meta_info.weight_version that is not a version string (up to 8 decimal digits): ['{shown}']" in message
    assert "not started by `rollout-service serve`" in message
    assert "not loading checkpoints" not in message


@pytest.mark.parametrize("version", ["4", 4, "0"], ids=["string", "int", "zero"])
def test_a_version_older_than_the_staleness_bound_allows_is_refused_after_retries(labelled: Any, version: Any) -> None:
    """Version 5 is required (max_staleness 0): an answer from this run's older weights is retried
    until sync_timeout, then refused naming the old version and the replica that does not catch up."""
    policy, server = labelled(version)
    with pytest.raises(StaleWeightsError) as caught:
        run(policy)
    message = str(caught.value)
    assert (
        f"weights of version(s) ['{version}'], but the trainer published version 5 and max_staleness=0 "
        "requires version >= 5; the replicas did not catch up" in message
    )
    assert "is not loading checkpoints" in message and "newer than any version" not in message
    assert len(server.generate_requests) >= 2  # retried until sync_timeout


def test_sglangs_start_up_version_is_still_blamed_on_a_replica_not_loading_checkpoints(labelled: Any) -> None:
    policy, _ = labelled("default")
    with pytest.raises(StaleWeightsError) as caught:
        run(policy)
    message = str(caught.value)
    assert "weights of version(s) ['default'], but the trainer published version 5" in message
    assert "is not loading checkpoints" in message


def test_one_parser_reads_a_version_the_same_as_int_or_string() -> None:
    for a, b in [(99999999, "99999999"), (10**8, "100000000"), (7, "7"), (0, "0")]:
        assert parse_weight_version(a) == parse_weight_version(b), (a, b)
    assert parse_weight_version(10**8) is None and parse_weight_version("99999999") == 99999999
    for junk in [" 5 ", "5.0", 5.0, True, [5], "\uff15", "default", None, -1]:
        assert parse_weight_version(junk) is None, junk


class Adapter:
    """Adapter sync: the trainer's newest adapter is version 5, named as the sidecars load it."""

    def current(self) -> tuple[int, str]:
        from rollout_service.protocol import adapter_name_for

        return 5, adapter_name_for(5, "R1")


@pytest.mark.parametrize("version", ["default", "9", "3", "5"])
def test_an_adapter_run_on_a_full_checkpoint_is_refused_not_labelled_the_adapters_version(
    labelled: Any, version: str
) -> None:
    """With adapter sync each completion is labelled with the adapter's version, SGLang's own being
    its base model's start-up ``"default"``. SGLang keeps adapters loaded across a full weight
    update, so a replica where a full checkpoint was loaded (another run's, a full publish into this
    root) answered the adapter's requests on those weights, and the answers passed as adapter
    version 5. A checkpoint's version from SGLang now means that: refused, named, after retries."""
    policy, server = labelled(version)
    policy.adapters = Adapter()  # type: ignore[assignment]
    if version == "default":  # the base model, as adapters need: taken as the adapter's version
        groups, record = run(policy)
        assert record.versions == [5, 5] and {c.raw_weight_version for c in groups[0]} == {"v00000005-R1"}
        assert server.generate_requests[0]["lora_path"] == "v00000005-R1"
        return
    with pytest.raises(StaleWeightsError) as caught:
        run(policy)
    message = str(caught.value)
    assert f"LoRA adapter run on full checkpoint version(s) ['{version}']" in message, message
    assert "base model" in message and "checkpoint_path of its own" in message
    assert len(server.generate_requests) >= 2  # retried until sync_timeout


def test_the_staleness_bound_counts_publishes_not_version_numbers(labelled: Any, tmp_path: Any) -> None:
    """A stray entry named like a step makes the numbering skip it (1, then 3): with
    ``max_staleness=1`` rollouts of the previous publish (1) were refused as two versions old, and
    the error blamed the replicas for not catching up."""
    import torch

    from rollout_service.checkpoint_format import step_dir_name
    from trainer_helpers import bare_publisher

    publisher = bare_publisher(tmp_path, None)
    try:
        publisher.publish_and_wait(publisher.next_version(), [("w", torch.zeros(4))])
        (tmp_path / step_dir_name(2)).write_text("stray")
        second = publisher.next_version()
        publisher.publish_and_wait(second, [("w", torch.ones(4))])
        assert (publisher.first_version, second) == (1, 3)
        policy, _ = labelled("1")  # the replicas still serve the previous publish
        policy = StaleRetryPolicy(policy.endpoints, publisher, NoWait(), max_staleness=1, sync_timeout_s=0.6)
        assert policy.required_version() == 1
        groups, record = run(policy)
        assert record.stale_retries == 0 and record.versions == [1, 1]
        strict = StaleRetryPolicy(policy.endpoints, publisher, NoWait(), max_staleness=0, sync_timeout_s=0.6)
        assert strict.required_version() == 3
        with pytest.raises(StaleWeightsError, match="requires version >= 3"):
            run(strict)
    finally:
        publisher.close()
