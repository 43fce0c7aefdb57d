"""Token ids from SGLang reach TRL as integers: coerced when integral, refused otherwise.

The training run uses the fake SGLang (`fake_sglang.FakeRollout` with ``float_token_ids``): a real
SGLang 0.5.23 always sends integer ids, so the float ids some servers and proxies send (JSON numbers
re-encoded as ``5.0``) cannot be had from it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from fake_sglang import VOCAB_SIZE, FakeRollout
from trainer_helpers import EmbeddingInputs, make_config, make_trainer
from trainer_hooks.sglang_responses import SGLangResponseError, parse_generate_response


def test_integral_float_token_ids_are_coerced_and_others_rejected() -> None:
    item = {
        "output_ids": [5.0, 7.0],
        "meta_info": {"weight_version": "3", "output_token_logprobs": [[-1.0, 5.0, None], [-2.0, 7, None]]},
    }
    [[completion]] = parse_generate_response([item], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)
    assert completion.token_ids == [5, 7] and all(type(t) is int for t in completion.token_ids)
    assert completion.weight_version == 3
    bad = copy.deepcopy(item)
    bad["output_ids"][1] = 7.5
    with pytest.raises(
        SGLangResponseError, match=r"output_ids\[1\]: expected an integer token id, found the non-integral"
    ):
        parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True)
    bad["output_ids"][1] = "7"
    with pytest.raises(SGLangResponseError, match="expected an integer token id, found '7'"):
        parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True)
    bad["output_ids"][1] = VOCAB_SIZE
    with pytest.raises(SGLangResponseError, match="outside the model's vocabulary"):
        parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)


def test_well_formed_answers_take_the_fast_path_with_the_same_result_and_checks() -> None:
    # Exact ints (what SGLang sends) are read in one pass; NaN logprobs become None either way,
    # and a logprob entry for another token, a negative id or an id beyond the vocabulary still fails.
    item = {
        "output_ids": [5, 7, 9],
        "meta_info": {
            "weight_version": "4",
            "output_token_logprobs": [[-1.0, 5, None], [float("nan"), 7, None], [-0.5, 9, None]],
        },
    }
    import trainer_hooks.sglang_responses as responses

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the checked path ran for a well-formed answer")

    with pytest.MonkeyPatch.context() as patch:  # proves the one-pass path served it
        patch.setattr(responses, "coerce_token_id", refuse)
        patch.setattr(responses, "_checked_logprobs", refuse)
        [[fast]] = parse_generate_response([item], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)
    slow_item = copy.deepcopy(item)
    slow_item["meta_info"]["output_token_logprobs"][2][0] = -1  # an int logprob: the checked path
    [[slow]] = parse_generate_response([slow_item], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)
    assert fast.token_ids == slow.token_ids == [5, 7, 9]
    assert fast.logprobs == [-1.0, None, -0.5] and slow.logprobs == [-1.0, None, -1.0]
    for path, value, message in [
        (("meta_info", "output_token_logprobs", 1, 1), 8, r"\[1\] is for token 8, output_ids\[1\] is 7"),
        (("output_ids", 0), -3, "outside the model's vocabulary"),
        (("output_ids", 2), VOCAB_SIZE, r"output_ids\[2\]: token id .* outside"),
    ]:
        bad = copy.deepcopy(item)
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(SGLangResponseError, match=message):
            parse_generate_response([bad], num_prompts=1, n=1, want_logprobs=True, vocab_size=VOCAB_SIZE)


def test_grpo_trains_on_integer_token_tensors_when_the_server_sends_floats(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    """Without coercion TRL would build float tensors from these ids and the embedding would crash."""
    fake.float_token_ids = True
    root = tmp_path / "ckpts"
    root.mkdir()
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, root, [fake.url], [fake.url], max_steps=2))
    inputs = EmbeddingInputs(trainer.model)
    try:
        trainer.train()
    finally:
        inputs.close()
    # The server did send float ids (what TRL would have built float tensors from) ...
    wire = fake.answer(fake.generate_requests[0])
    assert all(type(t) is float for item in wire for t in item["output_ids"]), wire[0]["output_ids"]
    # ... and the model only ever saw integer ones.
    assert inputs.dtypes and all(d in (torch.int64, torch.int32) for d in inputs.dtypes), inputs.dtypes
    assert all(type(v) is int for record in trainer.vllm_generation.history for v in record.versions)
