"""llama-server's API (/completion, /tokenize, /detokenize, /apply-template, /props,
/lora-adapters) over in-process workers on a tiny model."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from tests.gateway.gateway_setup import INVOCATION, PROMPT, SCHEMA, auth


def test_llama_server_logit_bias_penalties_and_min_p(client) -> None:
    def tokens(**kw) -> list[int]:
        body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True, **kw}
        r = client.post("/completion", headers=auth(), json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    greedy = tokens()
    assert tokens(logit_bias=[[greedy[0], False]])[0] != greedy[0]  # false bans, as in llama-server
    assert tokens(logit_bias={str(greedy[0]): -100})[0] != greedy[0]
    assert set(tokens(logit_bias=[[9, 100]])) == {9}
    # a heavy repeat penalty over the context: no token of the last 64 comes back while it is in the window
    penalized = tokens(repeat_penalty=10.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert not set(penalized) & set(PROMPT) and len(set(penalized)) == len(penalized)
    assert tokens(repeat_penalty=10.0, repeat_last_n=0) == greedy  # a window of 0 turns it off
    bad = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "logit_bias": [[5, "up"]]})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_llama_server_json_schema_and_gbnf_grammar(client) -> None:
    def complete(**kw):
        body = {"prompt": PROMPT, "n_predict": 40, "temperature": 0.8, "seed": 5, **kw}
        r = client.post("/completion", headers=auth(), json=body)
        assert r.status_code == 200, r.text
        return r.json()

    jsonschema.validate(json.loads(complete(json_schema=SCHEMA)["content"]), SCHEMA)
    answer = complete(grammar='root ::= ("yes" | "no") "!"')["content"]
    assert answer in ("yes!", "no!")
    bad = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "grammar": "root ::= ("})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("grammar:")
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    empty = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "json_schema": cycle})
    assert empty.status_code == 400 and empty.json()["error"]["message"].startswith("json_schema:")



def test_llama_server_logit_bias_strings_are_bounded(client, monkeypatch) -> None:
    import gateway.api.llama.sampling as sampling

    monkeypatch.setattr(sampling, "MAX_BIAS_TEXT_CHARS", 100)  # the test server's bodies are small
    long_bias = client.post("/completion", headers=auth(),
                            json={"prompt": PROMPT, "logit_bias": [["hello world " * 10, 1]]})
    assert long_bias.status_code == 400
    assert "logit_bias strings total 120 characters, over 100" in long_bias.json()["error"]["message"]
    monkeypatch.setattr(sampling, "MAX_LOGIT_BIAS", 3)
    many = client.post("/completion", headers=auth(),
                       json={"prompt": PROMPT, "logit_bias": [["hello there, world", 1]]})
    assert many.status_code == 400 and "over 3" in many.json()["error"]["message"]


def test_llama_server_n_probs_and_the_fields_its_clients_read(client) -> None:
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "ignore_eos": True, "n_probs": 3, "return_tokens": True}
    whole = client.post("/completion", headers=auth(), json=body).json()
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"] and all(len(p["top_logprobs"]) == 3 for p in probs)
    # greedy: the top one
    assert all(p["top_logprobs"][0]["id"] == p["id"] and p["logprob"] == p["top_logprobs"][0]["logprob"] for p in probs)
    assert all(bytes(p["bytes"]).decode("utf-8", "replace") == p["token"] for p in probs)
    assert (whole["index"], whole["stopping_word"], whole["truncated"]) == (0, "", False)
    settings = whole["generation_settings"]
    assert (settings["n_predict"], settings["n_probs"], settings["temperature"], settings["min_p"]) == (4, 3, 0.0, 0.05)
    streamed = client.post("/completion", headers=auth(), json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert [p for e in events for p in e.get("completion_probabilities", [])] == probs
    assert whole["stop_type"] == "limit"
    text = client.post("/completion", headers=auth(), json={**body, "n_predict": 12, "n_probs": 0}).json()["content"]
    word = text[3:5]
    stopped = client.post("/completion", headers=auth(),
                          json={**body, "n_predict": 12, "n_probs": 0, "stop": ["zzzz", word]}).json()
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert stopped["content"] == text[: text.find(word)]


def test_post_sampling_probs_are_those_of_the_filtered_distribution(client) -> None:
    greedy = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "n_predict": 3, "temperature": 0,
                                                              "ignore_eos": True, "n_probs": 4,
                                                              "post_sampling_probs": True}).json()
    for p in greedy["completion_probabilities"]:  # greedy keeps one token: certain
        assert p["prob"] == 1.0 and [(t["id"], t["prob"]) for t in p["top_probs"]] == [(p["id"], 1.0)]
        assert "logprob" not in p
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.5, "top_k": 3, "min_p": 0, "seed": 4, "ignore_eos": True,
            "n_probs": 5, "return_tokens": True}
    post = client.post("/completion", headers=auth(), json={**body, "post_sampling_probs": True}).json()
    model = client.post("/completion", headers=auth(), json=body).json()
    assert post["tokens"] == model["tokens"]  # the same draws; only what is reported differs
    for p, m in zip(post["completion_probabilities"], model["completion_probabilities"]):
        tops = p["top_probs"]
        # top_k 3: three left, renormalised
        assert len(tops) == 3 and sum(t["prob"] for t in tops) == pytest.approx(1.0, abs=1e-5)
        # ignore_eos masks the EOG tokens
        assert [t["id"] for t in tops] == [t["id"] for t in m["top_logprobs"] if t["id"] not in (0, 2)][:3]
        assert p["prob"] == pytest.approx(next(t["prob"] for t in tops if t["id"] == p["id"]))
        assert p["prob"] != pytest.approx(math.exp(m["logprob"]), abs=1e-3)  # not the model's probability
    assert post["generation_settings"]["post_sampling_probs"] is True


def test_llama_server_tokenize_detokenize_apply_template_and_props(client) -> None:
    tokens = client.post("/tokenize", headers=auth(), json={"content": "hello there"}).json()["tokens"]
    assert client.post("/detokenize", headers=auth(), json={"tokens": tokens}).json()["content"] == "hello there"
    pieces = client.post("/tokenize", headers=auth(),
                         json={"content": "hello <|im_end|>", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "hello <|im_end|>"
    assert pieces[-1]["piece"] == "<|im_end|>"  # parse_special by default
    literal = client.post("/tokenize", headers=auth(),
                          json={"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert len(literal) > 1
    prompt = client.post("/apply-template", headers=auth(),
                         json={"messages": [{"role": "user", "content": "hi"}]}).json()["prompt"]
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    props = client.get("/props", headers=auth()).json()
    assert props["chat_template"] and props["default_generation_settings"]["n_ctx"] == 128
    assert "/" not in props["model_path"]
    bad = client.post("/detokenize", headers=auth(), json={"tokens": [10**6]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
    assert client.post("/tokenize", json={"content": "x"}).status_code == 401


def test_tokenize_and_props_as_llama_servers_own_tests_read_them(client, monkeypatch) -> None:
    def tokenize(**body) -> list:
        r = client.post("/tokenize", headers=auth(), json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    monkeypatch.setattr(client.app.state.gateway.catalog.tokenizer, "add_bos", True)  # the tiny model adds none
    text = tokenize(content="hello there")
    assert tokenize(content="hello there", add_special=True) == [1, *text]  # test_tokenize_with_bos
    # content mixing token ids and text (llama-server's tokenize_mixed): ids kept, a BOS only before leading text
    assert tokenize(content=[7, "hello there", 9], add_special=True) == [7, *text, 9]
    assert tokenize(content=["hello there", 9, "hello there"], add_special=True) == [1, *text, 9, *text]
    assert tokenize(content=["hello there"]) == text
    content = "a test string with unicode \u5abd and emoji \U0001f917"
    pieces = tokenize(content=content, with_pieces=True)  # test_tokenize_with_pieces: bytes where not UTF-8
    assert all(set(p) == {"id", "piece"} and p["piece"] for p in pieces)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) == \
        content.encode()
    assert [p["id"] for p in pieces] == tokenize(content=content)
    for bad, fragment in (([10**6], "out of range"), ([True], "got an element true"), ({"a": 1}, "content")):
        r = client.post("/tokenize", headers=auth(), json={"content": bad})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    props = client.get("/props", headers=auth()).json()
    assert props["model_path"].endswith(".gguf") and "/" not in props["model_path"]  # test_server_props
    assert props["model_alias"] == "tiny" and props["total_slots"] == 4 and props["is_sleeping"] is False
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}


def test_llama_server_completion_and_lora_adapters(client) -> None:
    listing = client.get("/lora-adapters", headers=auth()).json()
    assert [(e["id"], e["name"], e["scale"]) for e in listing] == [(0, "a", 0.0), (1, "b", 0.0), (2, "alo", 0.0),
                                                                   (3, "alo2", 0.0)]
    assert listing[2]["alora_invocation_tokens"] == INVOCATION

    def complete(**kw):
        body = {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "ignore_eos": True, "return_tokens": True, **kw}
        r = client.post("/completion", headers=auth(), json=body)
        assert r.status_code == 200, r.text
        return r.json()

    base = complete()
    assert base["tokens_predicted"] == 5 and base["stop_type"] == "limit" and base["timings"]["predicted_n"] == 5
    assert complete(lora=[{"id": 0, "scale": 0.0}])["tokens"] == base["tokens"]
    with_a = complete(lora=[{"id": 0, "scale": 1.0}])
    assert with_a["tokens"] != base["tokens"]
    set_scales = client.post("/lora-adapters", headers=auth(), json=[{"id": 0, "scale": 1.0}])
    assert set_scales.status_code == 200 and set_scales.json()[0]["scale"] == 1.0
    try:
        assert complete()["tokens"] == with_a["tokens"]  # the tenant's default scales apply without a `lora` field
        assert complete(lora=[])["tokens"] == base["tokens"]  # an explicit list replaces them
        # another tenant's defaults are its own
        assert client.get("/lora-adapters", headers=auth("t2")).json()[0]["scale"] == 0.0
    finally:
        client.post("/lora-adapters", headers=auth(), json=[{"id": 0, "scale": 0.0}])
    streamed = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "n_predict": 5, "temperature": 0,
                                                                "ignore_eos": True, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True and "".join(e["content"] for e in events) == base["content"]


def test_completion_answers_in_llama_servers_shape(client) -> None:
    body = {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "ignore_eos": True}
    whole = client.post("/completion", headers=auth(), json=body).json()
    assert whole["tokens"] == [] and whole["tokens_predicted"] == 5  # ids only with return_tokens, as llama-server
    assert whole["prompt"] == client.post("/detokenize", headers=auth(), json={"tokens": PROMPT}).json()["content"]
    assert whole["has_new_line"] == ("\n" in whole["content"]) and whole["tokens_cached"] == len(PROMPT) + 5 - 1
    timings = whole["timings"]
    assert timings["predicted_n"] == 5 and timings["cache_n"] + timings["prompt_n"] == len(PROMPT)
    settings = whole["generation_settings"]
    assert settings["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"] and settings["mirostat"] == 0
    assert settings["seed"] == 0xFFFFFFFF and settings["stream"] is False  # random, reported as llama-server does
    streamed = client.post("/completion", headers=auth(), json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    partial, last = events[:-1], events[-1]
    counts = [e["tokens_predicted"] for e in partial]  # one token an event, unless the client fell behind (then merged)
    assert counts[-1] == 5 and not any(e["stop"] for e in partial)
    assert [len(e["tokens"]) for e in partial] == [b - a for a, b in zip([0, *counts], counts)]
    assert all(counts[i] < counts[i + 1] for i in range(len(counts) - 1))
    assert "".join(e["content"] for e in partial) == whole["content"]
    assert last["stop"] and last["content"] == "" and last["stop_type"] == "limit"
    assert last["generation_settings"]["stream"] is True


@pytest.mark.parametrize(("field", "value"), [("mirostat", 2), ("typical_p", 0.5), ("dry_multiplier", 0.8),
                                              ("xtc_probability", 0.5), ("samplers", ["top_k", "temperature"])])
def test_llama_samplers_we_do_not_run_are_refused_by_name(client, field, value) -> None:
    r = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "n_predict": 1, field: value})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"'{field}' is " in message and "supported" in message
    unused = {"mirostat": 0, "typical_p": 1.0}.get(field)
    off = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "n_predict": 1, field: unused})
    assert off.status_code == 200, off.text  # their "off" values are fine


@pytest.mark.parametrize("samplers", ["edkypmxt",
                                      ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                       "temperature"],
                                      ["top_k", "top_p", "min_p", "temperature"]])
def test_llama_servers_own_sampler_orders_are_ours(client, samplers) -> None:
    """llama-server's default order (list or string), its web UI's, or ours without the off ones: all run as ours."""
    r = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "n_predict": 1, "samplers": samplers})
    assert r.status_code == 200, r.text


def test_streamed_completion_reports_a_new_line_anywhere_in_it(client) -> None:
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True}
    whole = client.post("/completion", headers=auth(), json=body).json()
    streamed = client.post("/completion", headers=auth(), json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["has_new_line"] == whole["has_new_line"] == ("\n" in whole["content"])
