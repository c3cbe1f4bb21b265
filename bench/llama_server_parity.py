"""Drive llama-server and loraplex side by side with the same bodies and report where a client
could tell them apart: fields one answer has and the other lacks, and greedy outputs that differ.

Not a test (llama-server is never a dependency): a check a developer runs against a llama-server
built from llama.cpp's source, on the same GGUF, e.g.

    llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf --port 8090 -np 4 --jinja &
    loraplex serve --port 8000 &
    python bench/llama_server_parity.py --llama http://127.0.0.1:8090 --loraplex http://127.0.0.1:8000 --key sk-loraplex-demo
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}]
GREEDY = {"temperature": 0}
CASES: list[tuple[str, str, dict[str, Any], tuple[str, ...]]] = [  # name, path, body, fields whose values must agree
    ("completion", "/completion", {"prompt": PROMPT, "n_predict": 16, **GREEDY}, ("content", "tokens", "stop_type", "tokens_predicted")),
    ("completion n_probs", "/completion", {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, **GREEDY}, ("content",)),
    ("completion post_sampling_probs", "/completion",
     {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, "post_sampling_probs": True, **GREEDY}, ("content",)),
    ("completion stop", "/completion", {"prompt": PROMPT, "n_predict": 32, "stop": [","], **GREEDY},
     ("content", "stop_type", "stopping_word")),
    ("completion json_schema", "/completion", {"prompt": "A JSON city:", "n_predict": 40, "json_schema": WEATHER, **GREEDY}, ()),
    ("completion grammar", "/completion", {"prompt": "Answer yes or no:", "n_predict": 4, "grammar": 'root ::= "yes" | "no"', **GREEDY},
     ("content",)),
    ("tokenize", "/tokenize", {"content": "Hello world <|im_start|>", "with_pieces": True}, ("tokens",)),
    ("detokenize", "/detokenize", {"tokens": [19556, 905, 216, 1]}, ("content",)),
    ("apply-template", "/apply-template", {"messages": [{"role": "system", "content": "Be brief."}, *CHAT]}, ("prompt",)),
    ("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, **GREEDY}, ()),
    ("chat logprobs", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, **GREEDY}, ()),
    ("chat json_object", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 40, "response_format": {"type": "json_object"}, **GREEDY}, ()),
    ("chat tool forced", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
                                                  "tool_choice": "required", "max_tokens": 60, **GREEDY}, ()),
    ("completions", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, **GREEDY}, ()),
    ("completion streamed", "/completion", {"prompt": PROMPT, "n_predict": 6, "n_probs": 2, "stream": True, **GREEDY}, ("content",)),
    ("chat streamed", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True},
                                               **GREEDY}, ()),
]


def shape(value: Any, prefix: str = "") -> set[str]:
    """Every key path in a JSON value (list items merged as [])."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            paths.add(f"{prefix}{key}")
            paths |= shape(item, f"{prefix}{key}.")
    elif isinstance(value, list):
        for item in value:
            paths |= shape(item, f"{prefix}[].")
    return paths


def answer(response: httpx.Response) -> Any:
    """A JSON answer; a stream as {"partial": its events but the last merged, "last": the last, "content": the text}."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.json()
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]
    merged: dict[str, Any] = {}
    for event in events[:-1]:
        merged.update(event)
    text = "".join(e.get("content") or "".join((c.get("delta") or {}).get("content") or "" for c in e.get("choices", [])) for e in events)
    return {"partial": merged, "last": events[-1], "content": text}


def pick(value: Any, path: str) -> Any:
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", default="http://127.0.0.1:8090")
    ap.add_argument("--loraplex", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default="sk-loraplex-demo", help="the loraplex tenant key")
    ap.add_argument("--show", action="store_true", help="print both answers of every case")
    args = ap.parse_args()
    ours = httpx.Client(base_url=args.loraplex, headers={"Authorization": f"Bearer {args.key}"}, timeout=120)
    theirs = httpx.Client(base_url=args.llama, timeout=120)
    differences = 0
    for name, path, body, agree in CASES:
        a, b = theirs.post(path, json=body), ours.post(path, json=body)
        notes = []
        if a.status_code != b.status_code:
            notes.append(f"status {a.status_code} vs {b.status_code}: {b.text[:200]}")
        else:
            ja, jb = answer(a), answer(b)
            missing, extra = sorted(shape(ja) - shape(jb)), sorted(shape(jb) - shape(ja))
            if missing:
                notes.append(f"fields only llama-server has: {', '.join(missing)}")
            if extra:
                notes.append(f"fields only loraplex has: {', '.join(extra)}")
            for field in agree:
                if pick(ja, field) != pick(jb, field):
                    notes.append(f"{field}: {json.dumps(pick(ja, field))[:120]} vs {json.dumps(pick(jb, field))[:120]}")
            if args.show:
                print(f"--- {name}\nllama-server: {json.dumps(ja)[:600]}\nloraplex:     {json.dumps(jb)[:600]}")
        differences += bool(notes)
        print(f"{'same' if not notes else 'DIFF'}  {name}" + "".join(f"\n      {n}" for n in notes))
    print(f"{differences} of {len(CASES)} cases differ")


if __name__ == "__main__":
    main()
