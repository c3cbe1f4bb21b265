"""Speculative decoding on the default model with its n-gram drafter: a rewrite that copies its
prompt is drafted and mostly accepted, and the output is decoding's, alone and beside other
requests with and without the reference adapter."""

from __future__ import annotations

from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig
from worker.engine.engine import Engine, EngineRequest

PARAGRAPH = ("The museum opens at nine in the morning and closes at six in the evning. Tickets can be bought online or at "
             "the entrance, and children under twelve get in for free when they come with an adult.")
NGRAM = SpeculativeConfig(method="ngram", max_draft=4, is_adaptive=False)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special=True, parse_special=True)


def test_a_copying_rewrite_is_drafted_accepted_and_exact(real_runner, real_tokenizer) -> None:
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=1)
    requests = [
        EngineRequest("copy", chat(real_tokenizer, f"Rewrite this with the spelling fixed:\n\n{PARAGRAPH}"), params),
        EngineRequest("copy-adapter", chat(real_tokenizer, f"Repeat this text exactly:\n\n{PARAGRAPH}"), params, {0: 1.0}),
        EngineRequest("free", chat(real_tokenizer, "What is 2 + 2?"), SamplingParams(max_tokens=16, temperature=0), {0: 0.5}),
    ]
    decoding = Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=3, slot_len=160))
    plain = decoding.run_all(requests)
    engine = Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=3, slot_len=160, speculative=NGRAM))
    spec = engine.run_all(requests)
    for r in requests:
        assert spec[r.request_id].token_ids == plain[r.request_id].token_ids, r.request_id
        assert spec[r.request_id].text == plain[r.request_id].text
    for a, b in zip(spec["copy"].logprobs, plain["copy"].logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4
    assert "museum" in spec["copy"].text
    copy = spec["copy"]
    assert copy.num_drafted >= 16 and copy.num_draft_accepted >= copy.num_drafted // 2  # most of a copy is drafted right
    assert engine.counters.steps < decoding.counters.steps
