"""Draft LoRAs (speculative.draft_adapters; worker/engine/speculative/draft_model.py): a sequence whose
adapter set has exactly one adapter with a draft LoRA drafts with it, at its scale and where it applies;
the output stays decoding's; the serve config and the worker refuse an unknown adapter, a missing file
and a LoRA that does not fit the draft model, naming the field."""

from __future__ import annotations

import shutil

import pytest

from gateway.config import ConfigError, parse_config
from tests.tinymodels import TinyModel, TinySpec, make_tiny_model, random_lora, write_adapter
from tests.worker.engine.conftest import INVOCATION
from tests.worker.engine.speculative.test_draft_model import assert_identical, run
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.engine.speculative.draft_model import DraftModel
from worker.lora.mapping import RequestAdapters

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> TinyModel:
    """A smaller model of tiny_llama's vocabulary: one narrower layer, other weights."""
    spec = TinySpec(arch="llama", seed=21, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, ffn_dim=64)
    return make_tiny_model(tmp_path_factory.mktemp("draft"), spec, name="draft.gguf")


@pytest.fixture(scope="module")
def small_loras(small, tmp_path_factory) -> list[str]:
    """Two draft LoRAs of the small model."""
    d = tmp_path_factory.mktemp("draft_loras")
    return [str(write_adapter(d / f"draft{i}.gguf", random_lora(small, ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"], 4, seed=30 + i)))
            for i in range(2)]


def fingerprint(runner: ModelRunner, slot: int) -> str:
    return runner.adapters[slot].fingerprint


def draft_config(draft_path: str, draft_adapters: dict[str, str]) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=draft_path, max_draft=4, is_adaptive=False, draft_adapters=draft_adapters)


# the choice of a sequence's draft LoRA


def test_a_sequence_drafts_with_the_one_draft_lora_of_its_adapters(runner, small, small_loras) -> None:
    # adapters a (slot 0) and the aLoRA (slot 3) have draft LoRAs, held in the draft model's slots 0 and 1
    loras = {fingerprint(runner, 0): small_loras[0], fingerprint(runner, 3): small_loras[1]}
    model = DraftModel.load(str(small.path), runner, 2, 32, loras)
    choose = model.draft_adapters
    assert choose(RequestAdapters({0: 0.5})) == RequestAdapters({0: 0.5})  # its own scale
    assert choose(RequestAdapters({0: 1.0, 1: -0.7})) == RequestAdapters({0: 1.0})  # stacked with one without: its alone
    assert choose(RequestAdapters({1: 1.0, 2: 1.0})) == RequestAdapters()  # none has one: the plain draft model
    assert choose(RequestAdapters()) == RequestAdapters()
    assert choose(RequestAdapters({1: 1.0}, 3, 0.8, 6)) == RequestAdapters({}, 1, 0.8, 6)  # an aLoRA's: from its activation
    assert choose(RequestAdapters({0: 1.0}, 3, 0.8, 6)) == RequestAdapters()  # two have one: plain
    assert choose(RequestAdapters({7: 1.0})) == RequestAdapters()  # a slot it does not know


def test_one_file_for_several_targets_is_held_once(runner, small, small_loras) -> None:
    loras = {fingerprint(runner, 0): small_loras[0], fingerprint(runner, 2): small_loras[0]}
    model = DraftModel.load(str(small.path), runner, 1, 32, loras)
    assert len(model.runner.adapters) == 1 and model.draft_adapters(RequestAdapters({2: 0.3})) == RequestAdapters({0: 0.3})


# the engine


def test_greedy_output_is_decodings_with_draft_loras_in_a_mixed_batch(runner, tokenizer, small, small_loras) -> None:
    prompts = [[5, 77, 140, 3, 200, 9, 31], [8, 1, 99, 42, 17, 250, 12, 60, 61], [30, 31, 32], [40, 41, *INVOCATION, 44], [100, 101]]
    scales = [{0: 1.0}, {2: 1.0}, {0: 0.6, 1: 0.5}, {3: 1.0}, {}]  # a (draft LoRA), c (none), a stacked, the aLoRA (draft LoRA), none
    reqs = [EngineRequest(f"r{i}", p, GREEDY, s) for i, (p, s) in enumerate(zip(prompts, scales))]
    expected, plain = run(runner, tokenizer, reqs)
    config = draft_config(str(small.path), {fingerprint(runner, 0): small_loras[0], fingerprint(runner, 3): small_loras[1]})
    got, spec = run(runner, tokenizer, reqs, config)
    assert_identical(expected, got)
    assert spec.counters.drafted_tokens > 0 and spec.counters.generated_tokens == plain.counters.generated_tokens
    assert spec.scheduler.num_free_slots == spec.config.num_seq_slots


def test_the_target_adapters_own_lora_as_its_draft_lora_drafts_what_the_target_picks(runner, tokenizer, tiny_llama) -> None:
    """The target as its own draft model: with adapter a's file as a's draft LoRA, a's sequences draft
    their own tokens; the plain draft model guesses the base's, which a's sequences reject more often."""
    prompts = [[5, 77, 140, 3, 200, 9, 31], [30, 31, 32], [100, 101], [8, 1, 99, 42]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [EngineRequest(f"a{i}", p, params, {0: 1.0}) for i, p in enumerate(prompts)]
    expected = run(runner, tokenizer, reqs)[0]
    own = {fingerprint(runner, 0): str(runner.adapters[0].path)}
    with_lora, lora_engine = run(runner, tokenizer, reqs, draft_config(str(tiny_llama.path), own))
    plain, plain_engine = run(runner, tokenizer, reqs, draft_config(str(tiny_llama.path), {}))
    assert_identical(expected, with_lora)
    assert_identical(expected, plain)
    lora_drafted, lora_accepted = lora_engine.counters.drafted_tokens, lora_engine.counters.accepted_draft_tokens
    plain_drafted, plain_accepted = plain_engine.counters.drafted_tokens, plain_engine.counters.accepted_draft_tokens
    assert lora_drafted >= 24 and lora_accepted >= 0.9 * lora_drafted  # only near ties between the two runners may differ
    assert plain_accepted / plain_drafted < lora_accepted / lora_drafted - 0.2
    assert lora_engine.counters.steps < plain_engine.counters.steps


# config


def test_the_worker_refuses_a_draft_lora_missing_or_not_fitting_its_draft_model(runner, tokenizer, small, small_loras, tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative.draft_adapters is only used with method draft"):
        SpeculativeConfig(method="ngram", draft_adapters={"a": small_loras[0]})
    fp = fingerprint(runner, 0)
    for lora, message in ((str(tmp_path / "missing.gguf"), rf"speculative.draft_adapters\[{fp}\]: no such file"),
                          (str(runner.adapters[0].path), rf"speculative.draft_adapters\[{fp}\]: .* does not fit the draft model")):
        with pytest.raises(ValueError, match=message):
            Engine(runner, tokenizer, EngineConfig(speculative=draft_config(str(small.path), {fp: lora})))


def test_the_serve_config_keys_draft_loras_by_adapter_and_checks_them(runner, tiny_llama, small, small_loras, tmp_path) -> None:
    target = runner.adapters[0]
    base = {"model": str(tiny_llama.path), "adapters": [{"name": "a", "path": str(target.path)}],
            "shards": [{"name": "s", "adapters": ["a"]}], "auth": "none", "state": {"ephemeral": True}}
    shutil.copy(small.path, tmp_path / "draft.gguf")
    shutil.copy(small_loras[0], tmp_path / "draft_a.gguf")
    other = "f" * 64  # a run-time adapter's fingerprint
    section = {"method": "draft", "draft_model": "draft.gguf", "draft_adapters": {"a": "draft_a.gguf", other: small_loras[1]}}
    config = parse_config({**base, "speculative": section}, tmp_path)
    settings = config.worker_spec("s").engine.speculative
    # names never reach a worker
    assert settings.draft_adapters == {target.fingerprint: str(tmp_path / "draft_a.gguf"), other: small_loras[1]}
    assert parse_config(config.model_dump(), tmp_path).worker_spec("s").engine.speculative == settings  # a dump loads again
    for draft_adapters, message in (({"nope": "draft_a.gguf"}, "speculative.draft_adapters: unknown adapter 'nope' \\(known: a\\)"),
                                    ({"a": "missing.gguf"}, r"speculative.draft_adapters\[a\]: no such file: .*missing.gguf"),
                                    ({"a": str(target.path)}, r"speculative.draft_adapters\[a\]: .* does not fit the draft model")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**base, "speculative": {**section, "draft_adapters": draft_adapters}}, tmp_path)
    with pytest.raises(ConfigError, match="speculative.draft_adapters is only used with method draft"):
        parse_config({**base, "speculative": {"method": "ngram", "draft_adapters": {"a": "draft_a.gguf"}}}, tmp_path)
