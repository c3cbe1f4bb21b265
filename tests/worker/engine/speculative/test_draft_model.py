"""The draft model (worker/engine/speculative/draft_model.py): its drafts are its own greedy
tokens, its KV is kept per sequence across drafts (rejected positions written over), and with
`method: draft` the engine's output is decoding's, token for token, in mixed adapter batches;
a draft model of another vocabulary, or none, is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
from gguf import GGUFWriter

from gateway.config import ConfigError, parse_config
from tests.tinymodels import TinySpec, make_tiny_model, tiny_vocab
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig, check_draft_model
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.engine.speculative.draft_model import DraftModel


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> str:
    """A smaller model of tiny_llama's vocabulary: one narrower layer, other weights."""
    spec = TinySpec(arch="llama", seed=21, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, ffn_dim=64)
    return str(make_tiny_model(tmp_path_factory.mktemp("draft"), spec, name="draft.gguf").path)


def speculative(draft_path: str) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=draft_path, max_draft=4, is_adaptive=False)


def requests(params: SamplingParams) -> list[EngineRequest]:
    prompts = [[5, 77, 140, 3, 200, 9, 31], [8, 1, 99, 42, 17, 250, 12, 60, 61], [30, 31, 32], [40, 41, 42, 43, 250, 12, 44], [100, 101]]
    scales = [{0: 1.0}, {3: 1.0}, {0: 1.0, 1: -0.7}, {3: 1.0, 1: 0.5}, {}]  # 3: the aLoRA (tests/worker/engine/conftest.py)
    return [EngineRequest(f"r{i}", p, params, s) for i, (p, s) in enumerate(zip(prompts, scales))]


def run(runner, tokenizer, reqs: list[EngineRequest], config: SpeculativeConfig | None = None) -> tuple[dict, Engine]:
    """Every choice's result, by (request id, choice), all requests in one batch."""
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96, max_step_tokens=24,
                                                    speculative=config or SpeculativeConfig()))
    for r in reqs:
        engine.add_request(r)
    results = {(r.request_id, i): engine.result(r.request_id, i) for r in reqs for i in range(r.params.n)}
    while engine.has_work():
        engine.step()
    return results, engine


def assert_identical(expected: dict, got: dict) -> None:
    for key, want in expected.items():
        have = got[key]
        assert have.token_ids == want.token_ids, key
        assert (have.text, have.finish_reason, have.stop_word) == (want.text, want.finish_reason, want.stop_word), key


def greedy(runner: ModelRunner, tokens: list[int], num_tokens: int) -> list[int]:
    """The model's greedy continuation, each position computed from scratch (no KV kept)."""
    out: list[int] = []
    for _ in range(num_tokens):
        seq = tokens + out
        out.append(int(runner.forward(seq, 0, runner.allocate_kv(1, len(seq)))[0].argmax()))
    return out


# the drafter


def test_a_drafter_keeps_its_kv_and_writes_over_rejected_positions(runner, small_draft) -> None:
    model = DraftModel.load(small_draft, runner, num_seq_slots=2, slot_len=64)
    next_token = model.next_token
    passes: list[tuple[int, int]] = []  # (start, tokens) of each draft model pass
    model.next_token = lambda slot, start, ids, *rest: passes.append((start, len(ids))) or next_token(slot, start, ids, *rest)
    drafter, rng = model.new_drafter(("r", 0)), random.Random(0)
    tokens = [5, 77, 140, 3, 200]
    for i in range(8):
        passes.clear()
        drafts = drafter.draft(tokens, 4)
        assert drafts == greedy(model.runner, tokens, 4)
        first_start, first_length = passes[0]
        assert first_start + first_length == len(tokens) and len(passes) == 4
        if i:  # only what came since the last draft runs: the drafts accepted past those fed back, and the target's token
            assert first_length <= 2
        num_accepted = rng.randint(0, 4)
        tokens = tokens + drafts[:num_accepted] + [rng.randrange(runner.hparams.vocab_size)]


def test_drafters_sharing_too_few_slots_run_their_tokens_again(runner, small_draft) -> None:
    model = DraftModel.load(small_draft, runner, num_seq_slots=1, slot_len=64)
    a, b = model.new_drafter(("a", 0)), model.new_drafter(("b", 0))
    ta, tb = [5, 77, 140], [9, 8, 7, 6]
    for _ in range(3):
        da, db = a.draft(ta, 3), b.draft(tb, 3)
        assert (da, db) == (greedy(model.runner, ta, 3), greedy(model.runner, tb, 3))
        ta, tb = ta + da[:1] + [11], tb + db + [12]


def test_a_draft_stops_at_the_end_of_its_slot(runner, small_draft) -> None:
    model = DraftModel.load(small_draft, runner, num_seq_slots=1, slot_len=8)
    drafter = model.new_drafter(("a", 0))
    assert len(drafter.draft([1, 2, 3, 4, 5, 6], 4)) == 3  # the last one fed back sits at position 7
    assert drafter.draft(list(range(1, 10)), 4) == []


# the engine


@pytest.mark.parametrize("draft", ["small", "same"])
def test_greedy_output_is_decodings_in_a_mixed_adapter_batch(runner, tokenizer, tiny_llama, small_draft, draft) -> None:
    path = small_draft if draft == "small" else str(tiny_llama.path)
    reqs = requests(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    expected, plain = run(runner, tokenizer, reqs)
    got, spec = run(runner, tokenizer, reqs, speculative(path))
    assert_identical(expected, got)
    assert spec.counters.drafted_tokens > 0
    assert spec.counters.generated_tokens == plain.counters.generated_tokens
    if draft == "same":  # the base's own guesses: the request without adapters accepts them, the others less often
        assert 0 < spec.counters.accepted_draft_tokens < spec.counters.drafted_tokens
        assert got[("r4", 0)].num_draft_accepted >= 0.9 * got[("r4", 0)].num_drafted > 0
    assert spec.scheduler.num_free_slots == spec.config.num_seq_slots


def test_a_draft_model_identical_to_the_target_is_accepted(runner, tokenizer, tiny_llama) -> None:
    prompts = [[5, 77, 140, 3, 200, 9, 31], [30, 31, 32], [100, 101], [8, 1, 99, 42]]
    reqs = [EngineRequest(f"p{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), {}) for i, p in enumerate(prompts)]
    expected, plain = run(runner, tokenizer, reqs)
    got, spec = run(runner, tokenizer, reqs, speculative(str(tiny_llama.path)))
    assert_identical(expected, got)
    drafted, accepted = spec.counters.drafted_tokens, spec.counters.accepted_draft_tokens
    assert drafted >= 24 and accepted >= 0.9 * drafted  # only near ties between its passes and the target's may differ
    assert spec.counters.steps < plain.counters.steps / 2


def test_n_choices_stop_strings_and_seeded_sampling_end_as_decoding_does(runner, tokenizer, tiny_llama) -> None:
    free = run(runner, tokenizer, requests(SamplingParams(max_tokens=30, temperature=0))[:1])[0]
    text = free[("r0", 0)].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # something decoding produces in the middle
    assert stop.strip()
    reqs = [EngineRequest(r.request_id, r.prompt_ids, SamplingParams(max_tokens=30 - 5 * i, temperature=0, stop=(stop,)), r.scales_by_slot)
            for i, r in enumerate(requests(SamplingParams()))]
    reqs += [EngineRequest("n", [5, 77, 140, 3], SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, ignore_eos=True), {0: 1.0}),
             EngineRequest("g", [9, 8, 7], SamplingParams(max_tokens=16, temperature=0, n=2, ignore_eos=True), {})]
    expected = run(runner, tokenizer, reqs)[0]
    got, spec = run(runner, tokenizer, reqs, speculative(str(tiny_llama.path)))  # drafts accepted past a stop, a length
    assert_identical(expected, got)
    assert spec.counters.accepted_draft_tokens > 0
    assert got[("r0", 0)].finish_reason == "stop" and got[("r0", 0)].stop_word == stop
    assert len({tuple(expected[("n", i)].token_ids) for i in range(3)}) == 3


# config


def test_the_config_refuses_a_draft_method_without_a_usable_draft_model(runner, tokenizer, tiny_llama, small_draft, tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative.draft_model is required with method draft"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="speculative.draft_model is only used with method draft"):
        SpeculativeConfig(method="ngram", draft_model=small_draft)
    check_draft_model(tiny_llama.path, small_draft)  # the same vocabulary
    with pytest.raises(ValueError, match="speculative.draft_model: no such file"):
        check_draft_model(tiny_llama.path, tmp_path / "missing.gguf")
    fewer_rows = tiny_llama.with_tensors(tmp_path / "fewer.gguf", {"token_embd.weight": tiny_llama.tensors["token_embd.weight"][:-8]})
    with pytest.raises(ValueError, match="speculative.draft_model: .* vocabulary of 264 tokens"):
        check_draft_model(tiny_llama.path, fewer_rows)
    with pytest.raises(ValueError, match=r"speculative.draft_model: .*tokens differ from the model's .*\(first at id 0\)"):
        check_draft_model(tiny_llama.path, _other_tokens(tmp_path / "other.gguf", tiny_llama.tensors["token_embd.weight"]))
    with pytest.raises(ValueError, match="speculative.draft_model"):  # the engine checks too (a worker loading it)
        Engine(runner, tokenizer, EngineConfig(speculative=speculative(str(fewer_rows))))


def test_the_serve_config_resolves_the_draft_model_and_checks_its_vocabulary(tiny_llama, small_draft, tmp_path) -> None:
    base = {"model": str(tiny_llama.path), "shards": [{"name": "s"}], "auth": "none", "state": {"ephemeral": True}}
    (tmp_path / "draft.gguf").write_bytes(open(small_draft, "rb").read())
    config = parse_config({**base, "speculative": {"method": "draft", "draft_model": "draft.gguf", "max_draft": 3}}, tmp_path)
    settings = config.worker_spec("s").engine.speculative
    assert (settings.method, settings.draft_model, settings.max_draft) == ("draft", str(tmp_path / "draft.gguf"), 3)
    assert parse_config(config.model_dump(), tmp_path).worker_spec("s").engine.speculative == settings  # a dump loads again
    fewer_rows = tiny_llama.with_tensors(tmp_path / "fewer.gguf", {"token_embd.weight": tiny_llama.tensors["token_embd.weight"][:-8]})
    for bad, message in (({"method": "draft"}, "speculative.draft_model is required"),
                         ({"method": "draft", "draft_model": "missing.gguf"}, "speculative.draft_model: no such file"),
                         ({"method": "draft", "draft_model": str(fewer_rows)}, "speculative.draft_model: .* vocabulary of 264")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**base, "speculative": bad}, tmp_path)


def _other_tokens(path, embedding: np.ndarray) -> str:
    """A model file (metadata and embedding only) with tiny_llama's number of tokens, in another order."""
    tokens = tiny_vocab()[0]
    w = GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", tokens[::-1])
    w.add_tensor("token_embd.weight", embedding.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
