"""A tiny Qwen3 whose chat template has Qwen3's thinking switch, served in-process: the reasoning
tests of this package share one per module. Its template opens the think block in the prompt when
thinking is on (as Qwen3's thinking-only and DeepSeek-R1's templates do), so a random model's whole
answer is thinking until a budget ends it; off, the template writes an empty think block, and an
answer a grammar forces to hold `<think>...</think>` is split as a Qwen3 answer is (on, a grammar
binds only what follows the thinking)."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.gateway.gateway_setup import KEYS, digest, local_serving, tiny_config
from tests.gateway.live_server import live_server
from tests.tinymodels import TinySpec, make_tiny_model

THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
# DeepSeek-R1's way: the template always opens the think block, and has no switch
NO_SWITCH_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# what a grammar makes the model say with thinking OFF (the grammar then binds the whole answer): a
# Qwen3 answer, thinking first
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
FORCED = "<think>\nI add two and two.\n</think>\n\nIt is four."
FORCED_GRAMMAR = 'root ::= "<think>\\nI add two and two.\\n</think>\\n\\nIt is four."'


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    spec = TinySpec(arch="qwen3", context_length=512, chat_template=THINKING_TEMPLATE, seed=5)
    return make_tiny_model(tmp_path_factory.mktemp("thinking"), spec, name="tiny-qwen3-thinking.gguf")


def _config(model, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    return tiny_config(model, tmp_path_factory.mktemp("gw"), prefix, adapters=[], shards=[{"name": "s1", "adapters": []}],
                       tenants=[{"id": "t1", "key_sha256": [digest(KEYS["t1"])]}],
                       http={"max_body_bytes": 65536, "allow_request_chat_template": True})


@pytest.fixture(scope="module")
def served(thinking_model, tmp_path_factory):
    with local_serving(_config(thinking_model, tmp_path_factory)) as (app, pool), TestClient(app) as client:
        yield client, app


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture(scope="module")
def url(thinking_model, tmp_path_factory):
    """A gateway of its own over real HTTP, for the SDKs (a module uses it or `client`, not both)."""
    with local_serving(_config(thinking_model, tmp_path_factory)) as (app, _), live_server(app) as base:
        yield base
