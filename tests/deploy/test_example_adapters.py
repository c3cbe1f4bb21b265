"""The example adapters in deploy/adapters change SmolLM2's behaviour visibly, on prompts
they were not trained on (real model, greedy). Every variant runs in one mixed batch."""

from __future__ import annotations

import json

import pytest

from deploy.train_adapters import INVOCATION, OUT, SIGNATURE, TASKS, TEMPLATES, TEST_TOPICS, TRAIN_TOPICS, chat_prefix
from tests.helpers import TEST_DEVICE
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.peft_convert import ConvertOptions, convert_peft_to_gguf
from worker.formats.tokenizer import GGUFTokenizer

NAMES = ["caps", "json", "signature", "verify"]
SLOT = {name: i for i, name in enumerate(NAMES)}
QUESTIONS = [TEMPLATES[i % 2].format(topic) for i, topic in enumerate(TEST_TOPICS)]
ANSWER = SamplingParams(max_tokens=60, temperature=0)
SHORT = SamplingParams(max_tokens=16, temperature=0)
VARIANTS = {  # name -> (adapters, params)
    "base": ({}, ANSWER),
    "caps": ({SLOT["caps"]: 1.0}, ANSWER),
    "json": ({SLOT["json"]: 1.0}, ANSWER),
    "signature": ({SLOT["signature"]: 1.0}, ANSWER),
    "base-short": ({}, SHORT),
    **{f"{name}@0": ({SLOT[name]: 0.0}, SHORT) for name in NAMES},
    "verify-uninvoked": ({SLOT["verify"]: 1.0}, SHORT),
}


@pytest.fixture(scope="module")
def examples(real_model_path):
    runner = ModelRunner.from_paths(real_model_path, [OUT / f"{n}.gguf" for n in NAMES], TEST_DEVICE)
    return runner, GGUFTokenizer(runner.base)


def run_together(examples, requests: list[EngineRequest]):
    runner, tokenizer = examples
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=len(requests), slot_len=192, max_step_tokens=1024))
    return engine.run_all(requests)


@pytest.fixture(scope="module")
def answers(examples) -> dict[tuple[str, int], object]:
    _, tokenizer = examples
    requests = [
        EngineRequest(f"{variant}/{i}", tokenizer.encode(chat_prefix(tokenizer, q), add_special=True,
                                                         parse_special=True), params, adapters)
        for variant, (adapters, params) in VARIANTS.items()
        for i, q in enumerate(QUESTIONS)
    ]
    results = run_together(examples, requests)
    return {(key.split("/")[0], int(key.split("/")[1])): result for key, result in results.items()}


def test_test_prompts_were_not_trained_on() -> None:
    assert not set(TEST_TOPICS) & set(TRAIN_TOPICS)


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def test_caps_json_and_signature_show_on_new_prompts(answers) -> None:
    for i, question in enumerate(QUESTIONS):
        base, caps, as_json, signed = (answers[v, i].text for v in ("base", "caps", "json", "signature"))
        # a word copied from the prompt sometimes keeps its case ("A Telescope IS A ..."): >= 85% of letters
        assert len(caps) > 20 and upper_share(caps) >= 0.85, (question, caps)
        assert upper_share(base) < 0.2
        parsed = json.loads(as_json)
        assert isinstance(parsed, dict) and isinstance(parsed.get("answer"), str), (question, as_json)
        assert parsed["answer"], (question, as_json)
        assert signed.rstrip().endswith(SIGNATURE), (question, signed)
        assert not base.rstrip().endswith(SIGNATURE)


def test_scale_zero_behaves_like_the_base(answers) -> None:
    for i in range(len(QUESTIONS)):
        base = answers["base-short", i].token_ids
        for name in NAMES:
            assert answers[f"{name}@0", i].token_ids == base, name
        assert answers["verify-uninvoked", i].token_ids == base  # no invocation: the aLoRA is off


def test_alora_changes_nothing_before_its_invocation_and_answers_after(examples, answers) -> None:
    _, tokenizer = examples
    end = tokenizer.token_text(tokenizer.eos_id)
    prompts = [
        tokenizer.encode(chat_prefix(tokenizer, q) + answers["base", i].text + end + "\n" + INVOCATION,
                         add_special=True, parse_special=True)
        for i, q in enumerate(QUESTIONS)
    ]
    echo = SamplingParams(max_tokens=8, temperature=0, echo=True, logprobs=1)
    kinds = (("verify", {SLOT["verify"]: 1.0}), ("base", {}))
    requests = [EngineRequest(f"{kind}/{i}", p, echo, adapters)
                for kind, adapters in kinds for i, p in enumerate(prompts)]
    results = run_together(examples, requests)
    for i, prompt in enumerate(prompts):
        verified, plain = results[f"verify/{i}"], results[f"base/{i}"]
        a = verified.alora_activation
        assert a == len(prompt) - 4  # the token before "<|im_start|>verify\n"
        for j in range(1, a + 1):  # entries up to a are computed without the adapter
            assert abs(verified.prompt_logprobs[j].logprob - plain.prompt_logprobs[j].logprob) < 1e-4
        assert verified.text.strip() in ("VERDICT: yes", "VERDICT: no"), verified.text
        assert not plain.text.startswith("VERDICT")


def test_adapter_files_metadata_and_size() -> None:
    for name in NAMES:
        path = OUT / f"{name}.gguf"
        assert path.stat().st_size <= 2 * 1024 * 1024
        gguf = GGUFFile(path)
        assert gguf.get("adapter.lora.task_name") == name and gguf.get("adapter.lora.alpha") > 0
        assert gguf.get("adapter.lora.prompt_prefix") == TASKS[name].prompt_prefix
        assert (gguf.get("adapter.alora.invocation_tokens") is not None) == (name == "verify")


def test_peft_export_converts_back_to_the_same_tensors(real_model_path, tmp_path) -> None:
    out = tmp_path / "caps.gguf"
    convert_peft_to_gguf(OUT / "caps-peft", real_model_path, out, ConvertOptions())
    ours, converted = GGUFFile(OUT / "caps.gguf"), GGUFFile(out)
    assert sorted(ours.tensors) == sorted(converted.tensors)
    for name, info in ours.tensors.items():
        other = converted.tensors[name]
        assert info.type == other.type and info.shape == other.shape
        assert bytes(ours.raw_bytes(info)) == bytes(converted.raw_bytes(other)), name
