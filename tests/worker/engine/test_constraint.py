"""Constrained decoding in the engine: every token follows the request's grammar (llguidance),
inside mixed batches, with other requests unconstrained; the grammar's end is the request's end."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers import TEST_DEVICE
from tests.tinymodels import random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest, RequestError
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.grammar import GrammarError, gbnf_grammar, json_object_grammar, json_schema_grammar
from worker.formats.tokenizer import GGUFTokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("grammar-adapters")
    paths = [
        write_adapter(d / f"g{i}.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight", "blk.1.ffn_up.weight"], 4, seed=40 + i))
        for i in range(2)
    ]
    runner = ModelRunner.from_paths(tiny_llama.path, paths, TEST_DEVICE)
    return runner, GGUFTokenizer(GGUFFile(tiny_llama.path))


def run(setup, requests, slots=4):
    runner, tokenizer = setup
    return Engine(runner, tokenizer, EngineConfig(num_seq_slots=slots, slot_len=128, max_step_tokens=16)).run_all(requests)


def test_json_schema_answers_validate_in_a_mixed_batch_beside_free_requests(setup) -> None:
    grammar = json_schema_grammar(SCHEMA)
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, grammar=grammar) for t, s in ((0, None), (1.0, 1), (1.0, 2))]
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    requests = [EngineRequest(f"j{i}", [5, 77, 140 + i], p, a) for i, (p, a) in enumerate(zip(params, [{0: 1.0}, {1: 0.8}, {}]))]
    requests.append(EngineRequest("free", [5, 77, 140], free, {0: 1.0}))
    results = run(setup, requests)
    for i in range(3):
        answer = results[f"j{i}"]
        assert answer.finish_reason == "stop", answer.text
        jsonschema.validate(json.loads(answer.text), SCHEMA)
    alone = run(setup, [EngineRequest("free", [5, 77, 140], free, {0: 1.0})], slots=1)["free"]
    assert results["free"].token_ids == alone.token_ids  # the unconstrained request is untouched
    assert len({results[f"j{i}"].text for i in range(3)}) > 1


def test_json_object_and_gbnf_are_obeyed_and_max_tokens_cuts_with_length(setup) -> None:
    obj = run(
        setup, [EngineRequest("o", [5, 77], SamplingParams(max_tokens=80, temperature=1.0, seed=3, grammar=json_object_grammar()))]
    )["o"]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    yes_no = gbnf_grammar('root ::= ("yes" | "no") " " [0-9] [0-9]?')
    answers = run(
        setup, [EngineRequest(f"g{s}", [5, 77], SamplingParams(max_tokens=20, temperature=1.0, seed=s, grammar=yes_no)) for s in range(4)]
    )
    for answer in answers.values():
        head, _, digits = answer.text.partition(" ")
        assert head in ("yes", "no") and digits.isdigit() and len(digits) <= 2, answer.text
    cut = run(setup, [EngineRequest("c", [5, 77], SamplingParams(max_tokens=3, temperature=0, grammar=json_schema_grammar(SCHEMA)))])["c"]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith('{"')


def test_a_grammar_that_cannot_be_enforced_is_the_requests_error_alone(setup) -> None:
    runner, tokenizer = setup
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=64))
    with pytest.raises(RequestError, match="the grammar cannot be enforced"):
        engine.add_request(
            EngineRequest("bad", [5], SamplingParams(max_tokens=4, grammar=json_schema_grammar({"type": "string", "format": "fancy"})))
        )
    with pytest.raises(GrammarError, match="GBNF|Lark|grammar"):
        gbnf_grammar("root ::= (")
    assert engine.run_all([EngineRequest("ok", [5, 77], SamplingParams(max_tokens=2, temperature=0))])["ok"].finish_reason == "length"


def test_a_schema_sent_again_is_not_compiled_again(setup) -> None:
    runner, tokenizer = setup
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=64))
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    engine.run_all([EngineRequest(f"r{i}", [5, 77], SamplingParams(max_tokens=12, temperature=0, grammar=grammar)) for i in range(3)])
    assert len(engine.grammars.compile_s) == 1


def test_constraints_that_leave_no_token_fail_the_request_alone_with_a_400(setup) -> None:
    runner, tokenizer = setup
    ban_all = tuple((t, -100.0) for t in range(runner.hparams.vocab_size))
    requests = [EngineRequest("none", [5, 77], SamplingParams(max_tokens=4, temperature=0, logit_bias=ban_all)),
                EngineRequest("fine", [5, 77], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    results = run(setup, requests)
    assert (results["none"].finish_reason, results["none"].error_status) == ("error", 400)
    assert "allow none" in results["none"].error and results["fine"].finish_reason == "length"


def test_a_schema_that_can_generate_nothing_is_refused_before_it_runs(setup) -> None:
    runner, tokenizer = setup
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=64))
    with pytest.raises(RequestError, match="the grammar cannot be enforced"):
        engine.check(EngineRequest("c", [5], SamplingParams(max_tokens=4, grammar=json_schema_grammar(cycle))))
    with pytest.raises(GrammarError, match="allows no value"):
        json_schema_grammar(False)
    anything = run(
        setup, [EngineRequest("t", [5, 77], SamplingParams(max_tokens=30, temperature=0, grammar=json_schema_grammar(True)))]
    )["t"]
    if anything.finish_reason == "stop":
        json.loads(anything.text)  # `true`: any JSON value
