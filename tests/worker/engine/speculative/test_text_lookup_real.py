"""`method: ngram` on the default model looks up text: a JSON answer copying its prompt's values
is drafted where its tokens differ from the prompt's, and the output is decoding's."""

from __future__ import annotations

from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.speculative.text_lookup import TextIndex
from worker.formats.chat_template import compiled
from worker.lora.mapping import RequestAdapters

NGRAM = SpeculativeConfig(method="ngram", max_draft=4, is_adaptive=False)
PROMPT = ("Extract the person's name, city, age and email from this text as a JSON object with the keys name, city, age "
          "and email.\n\nText: My name is Ada Lovelace, I am 36 years old and I live in London. You can write to me at "
          "ada@example.org.")


def test_a_json_answer_is_drafted_from_its_prompts_text_and_exact(real_runner, real_tokenizer) -> None:
    template = compiled(real_tokenizer.chat_template, "")  # with its default system prompt, as bench/bench_speculative.py
    prompt = real_tokenizer.encode(template.render([{"role": "user", "content": PROMPT}]), add_special=False, parse_special=True)
    request = EngineRequest("json", prompt, SamplingParams(max_tokens=48, temperature=0))
    decoding = Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=1, slot_len=160))
    plain = decoding.run_all([request])["json"]
    engine = Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=1, slot_len=160, speculative=NGRAM))
    assert isinstance(engine.speculator._new_drafter(("json", 0), RequestAdapters()), TextIndex)
    spec = engine.run_all([request])["json"]
    assert spec.token_ids == plain.token_ids
    assert '"name": "Ada Lovelace"' in spec.text
    assert spec.num_draft_accepted >= 8, (spec.num_drafted, spec.num_draft_accepted)
    assert engine.counters.steps < decoding.counters.steps
