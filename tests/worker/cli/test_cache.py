"""`loraplex generate --redis`: separate processes share prompt KV through the machine's Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import redis

from cache.codec import decode
from tests.redis_server import free_port

PROMPT = ",".join(str((11 * i + 2) % 240) for i in range(45))


def generate(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "gateway.cli", "generate", "--temperature", "0", "--ignore-eos", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> tuple[dict, str]:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return json.loads(out), err


def tiny_args(model, prefix: str, *extra: str) -> list[str]:
    return ["--model", str(model.path), "--prompt-tokens", PROMPT, "-n", "6", "--json", "--logprobs", "1",
            "--redis", "redis://127.0.0.1:6379/0", "--cache-prefix", prefix, "--cache-chunk-tokens", "8", *extra]


def test_a_second_process_reuses_the_first_ones_prompt_and_another_salt_does_not(tiny_llama, redis_prefix) -> None:
    first, _ = finish(generate(*tiny_args(tiny_llama, redis_prefix)))
    second, _ = finish(generate(*tiny_args(tiny_llama, redis_prefix)))
    other_tenant, _ = finish(generate(*tiny_args(tiny_llama, redis_prefix, "--cache-salt", "tenant-b")))
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == 40 and other_tenant["cached_tokens"] == 0
    assert second["tokens"] == first["tokens"] == other_tenant["tokens"]


def test_two_processes_writing_the_same_chunks_at_once_leave_valid_values(tiny_llama, redis_prefix) -> None:
    writers = [generate(*tiny_args(tiny_llama, redis_prefix)) for _ in range(2)]
    results = [finish(w)[0] for w in writers]
    client = redis.Redis()
    values = [client.get(k) for k in client.scan_iter(f"{redis_prefix}:kv:*")]
    assert len(values) == (45 + 6 - 1) // 8
    reader, _ = finish(generate(*tiny_args(tiny_llama, redis_prefix)))
    assert reader["cached_tokens"] == 40 and reader["tokens"] == results[0]["tokens"] == results[1]["tokens"]
    positions = sorted(decode(v, json.loads(v[8 : 8 + int.from_bytes(v[4:8], "little")])["model"]).first_position for v in values)
    assert positions == [0, 8, 16, 24, 32, 40]


def test_without_redis_it_still_answers_and_says_so(tiny_llama) -> None:
    args = tiny_args(tiny_llama, "loraplex-test")
    args[args.index("--redis") + 1] = f"redis://127.0.0.1:{free_port()}/0"
    out, err = finish(generate(*args))
    assert out["cached_tokens"] == 0 and len(out["tokens"]) == 6
    assert "was unavailable: ran uncached" in err


def test_cache_flags_are_checked(tiny_llama) -> None:
    bad_url = generate("--model", str(tiny_llama.path), "--prompt-tokens", "1,2", "--redis", "http://x")
    salt_alone = generate("--model", str(tiny_llama.path), "--prompt-tokens", "1,2", "--cache-salt", "t")
    for process, message in ((bad_url, "redis url must start with"), (salt_alone, "--cache-salt needs --redis")):
        _, err = process.communicate(timeout=60)
        assert process.returncode == 2 and message in err


def test_the_default_model_chat_twice_prints_cached_tokens(redis_prefix) -> None:
    args = ["--chat", "Name three primary colors.", "-n", "12", "--redis", "redis://127.0.0.1:6379/0",
            "--cache-prefix", redis_prefix, "--cache-chunk-tokens", "16"]
    first, second = (generate(*args).communicate(timeout=180) for _ in range(2))
    assert "(0 cached)" in first[1] and "(32 cached)" in second[1], second[1]
    assert first[0] == second[0] and first[0].strip()
