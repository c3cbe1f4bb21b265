"""The default model and llama.cpp's reference adapter compute what llama.cpp computes.

Teacher-forced on llama.cpp's greedy tokens (--echo --logprobs): our top-1 equals
llama.cpp's at >= 95% of positions; elsewhere llama.cpp's log-probability of our
token is within 0.35 of its top-1 (a near tie: llama.cpp computes Q4_1 with
8-bit activations).
"""

from __future__ import annotations

import hashlib

import pytest

from tests.helpers import LLAMACPP_SCALES, teacher_forced_against_llama_cpp
from worker.contract.params import SamplingParams
from worker.engine.generate import generate


def test_reference_adapter_is_the_one_llama_cpp_used(small_adapter_path, llamacpp_reference) -> None:
    digest = hashlib.sha256(small_adapter_path.read_bytes()).hexdigest()
    assert digest == llamacpp_reference["adapter_sha256"]["small.gguf"]


def test_teacher_forced_completions_match_llama_cpp(real_runner, real_tokenizer, llamacpp_reference) -> None:
    matched, total, misses = teacher_forced_against_llama_cpp(real_runner, real_tokenizer, llamacpp_reference)
    assert total == 96
    assert matched / total >= 0.95, misses


@pytest.mark.parametrize("config", ["base", "small@1.0"])
def test_greedy_generation_reproduces_llama_cpp(real_runner, real_tokenizer, llamacpp_reference, config) -> None:
    """Where llama.cpp's greedy path has no near tie, free-running generation gives its exact text."""
    for case in (c for c in llamacpp_reference["completions"] if c["config"] == config):
        params = SamplingParams(max_tokens=len(case["tokens"]), temperature=0, ignore_eos=True)
        result = generate(real_runner, case["prompt_tokens"], params, {0: LLAMACPP_SCALES[config]}, real_tokenizer)
        assert result.token_ids == case["tokens"]
        assert result.text == case["content"]
