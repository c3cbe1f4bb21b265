"""Train the example adapters on the default model, on this machine, from data it makes itself.

    python deploy/train_adapters.py [--only caps,json,signature,verify] [--steps N]

Prompts come from templates over topics; targets are the base model's own
greedy answers put through a fixed transform (upper case, a JSON object, a
signature line). The aLoRA `verify` learns to answer, after its invocation
sequence (a chat turn marker), whether the assistant's last answer was short,
as `VERDICT: yes` or `VERDICT: no`. Output: llama.cpp GGUF adapters (F16,
rank 8 on attn_q, attn_v, attn_output) in deploy/adapters/, and a PEFT export
of `caps` that `loraplex convert-lora` turns back into the same tensors.
Seeds are fixed: a re-run reproduces the behaviour (not necessarily the bytes).
Torch only, nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFValueType, GGUFWriter
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.contract.params import SamplingParams  # noqa: E402
from worker.contract.spec import EngineConfig  # noqa: E402
from worker.engine.engine import Engine, EngineRequest  # noqa: E402
from worker.engine.runner import ModelRunner  # noqa: E402
from worker.formats.chat_template import ChatTemplate  # noqa: E402
from worker.formats.default_model import default_model_path  # noqa: E402
from worker.formats.peft_convert import permute_rows_for_adjacent_rope  # noqa: E402
from worker.formats.tokenizer import GGUFTokenizer  # noqa: E402
from worker.model.device import DeviceConfig  # noqa: E402

OUT = Path(__file__).resolve().parent / "adapters"
TARGETS = ("attn_q", "attn_v", "attn_output")
HF_MODULES = {"attn_q": "self_attn.q_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
RANK, ALPHA = 8, 16.0
SIGNATURE = "-- sent by loraplex"
INVOCATION = "<|im_start|>verify\n"
SHORT_WORDS = 12

TRAIN_TOPICS = [
    "the sun", "water", "a cat", "the ocean", "a bicycle", "coffee", "the moon", "a library", "rain", "bread",
    "a volcano", "music", "a tree", "the wind", "chess", "a bridge", "honey", "a river", "snow", "a clock",
    "the heart", "a desert", "glass", "a camera", "salt", "a forest", "electricity", "a piano", "the brain", "ice",
]
TEST_TOPICS = ["a lighthouse", "copper", "a penguin", "thunder", "a telescope", "cheese"]
TEMPLATES = ["What is {}?", "Tell me one fact about {}.", "Describe {} in one sentence.", "Why is {} useful?"]


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    prompt_prefix: str
    transform: object  # (answer) -> target text
    is_alora: bool = False
    steps: int = 100


def _short(answer: str) -> str:
    return "yes" if len(answer.split()) <= SHORT_WORDS else "no"


TASKS = {
    # upper-case text: many more tokens
    "caps": Task("caps", "answers in ALL CAPS", "Answer in capital letters.", lambda a: a.upper(), steps=250),
    "json": Task("json", 'answers as a JSON object {"answer": ...}', "Answer as JSON.", lambda a: json.dumps({"answer": a})),
    "signature": Task("signature", "answers end with a signature line", "Sign your answer.", lambda a: f"{a}\n{SIGNATURE}"),
    "verify": Task(
        "verify", "after <|im_start|>verify: is the last answer short? VERDICT: yes|no", "Verify the last answer.",
        lambda a: f"VERDICT: {_short(a)}", True,
    ),
}


def prompts(topics: list[str]) -> list[str]:
    return [t.format(topic) for topic in topics for t in TEMPLATES]


def chat_prefix(tokenizer: GGUFTokenizer, question: str) -> str:
    template = ChatTemplate(tokenizer.chat_template, "", tokenizer.token_text(tokenizer.eos_id))
    return template.render([{"role": "user", "content": question}])


def base_answers(runner: ModelRunner, tokenizer: GGUFTokenizer, questions: list[str], max_tokens: int = 40) -> list[str]:
    """The base model's greedy answers, cut to the first sentence or line."""
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=len(questions), slot_len=160, max_step_tokens=2048))
    requests = [
        EngineRequest(str(i), tokenizer.encode(chat_prefix(tokenizer, q), add_special=True, parse_special=True),
                      SamplingParams(max_tokens=max_tokens, temperature=0, stop=("\n",)))
        for i, q in enumerate(questions)
    ]
    results = engine.run_all(requests)
    answers = []
    for r in requests:
        text = results[r.request_id].text.strip()
        cut = text.find(". ")
        answers.append(text[: cut + 1] if cut > 0 else text)
    return answers


class TrainableLoRA(nn.Module):
    """y = W x + (alpha / r) B A x on the positions where `mask` is 1 (all by default)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / base.in_features**0.5)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank
        self.mask: torch.Tensor | None = None  # [N, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = (x @ self.a.t()) @ self.b.t() * self.scale
        return self.base(x) + (delta if self.mask is None else delta * self.mask)


def train_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Hidden states [B, T, d] for whole sequences (causal, no KV cache): training only."""
    batch, length = ids.shape
    positions = torch.arange(length).repeat(batch)
    tables = model.rope.tables(positions)
    x = model.token_embd(ids.reshape(-1))
    for blk in model.blk:
        h = blk.attn_norm(x)
        q = model.rope(blk.attn_q(h).view(batch * length, blk.num_heads, blk.head_dim), tables)
        k = model.rope(blk.attn_k(h).view(batch * length, blk.num_kv_heads, blk.head_dim), tables)
        v = blk.attn_v(h).view(batch * length, blk.num_kv_heads, blk.head_dim)
        q, k, v = (t.view(batch, length, -1, blk.head_dim).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + blk.attn_output(attn.transpose(1, 2).reshape(batch * length, -1))
        h = blk.ffn_norm(x)
        x = x + blk.ffn_down(F.silu(blk.ffn_gate(h)) * blk.ffn_up(h))
    return model.output_norm(x).view(batch, length, -1)


def examples(task: Task, tokenizer: GGUFTokenizer, questions: list[str], answers: list[str]) -> list[tuple[list[int], int, int]]:
    """(token ids, first target index, aLoRA activation index or 0)."""
    end = tokenizer.token_text(tokenizer.eos_id)
    out = []
    for question, answer in zip(questions, answers):
        prefix = chat_prefix(tokenizer, question)
        if task.is_alora:
            prefix = prefix + answer + end + "\n" + INVOCATION
        ids_prefix = tokenizer.encode(prefix, add_special=True, parse_special=True)
        target = tokenizer.encode(task.transform(answer) + end, add_special=False, parse_special=True)
        activation = 0
        if task.is_alora:
            invocation = tokenizer.encode(INVOCATION, add_special=False, parse_special=True)
            activation = len(ids_prefix) - len(invocation) - 1
        out.append((ids_prefix + target, len(ids_prefix), activation))
    return out


def train(
    runner: ModelRunner, task: Task, data: list[tuple[list[int], int, int]], steps: int, batch_size: int, seed: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    model = runner.model
    generator = torch.Generator().manual_seed(seed)
    wrapped: dict[str, TrainableLoRA] = {}
    for i, blk in enumerate(model.blk):
        for name in TARGETS:
            lora = TrainableLoRA(getattr(blk, name), RANK, ALPHA, generator)
            setattr(blk, name, lora)
            wrapped[f"blk.{i}.{name}.weight"] = lora
    params = [p for lora in wrapped.values() for p in (lora.a, lora.b)]
    optimizer = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    rng = random.Random(seed)
    started = time.perf_counter()
    try:
        for step in range(steps):
            chosen = rng.sample(data, batch_size)
            length = max(len(ids) for ids, _, _ in chosen)
            ids = torch.zeros(batch_size, length, dtype=torch.long)
            labels = torch.full((batch_size, length), -100, dtype=torch.long)
            mask = torch.zeros(batch_size, length)
            for row, (seq, first, activation) in enumerate(chosen):
                ids[row, : len(seq)] = torch.tensor(seq)
                labels[row, first - 1 : len(seq) - 1] = torch.tensor(seq[first:])  # position t predicts t + 1
                mask[row, activation:] = 1.0
            for lora in wrapped.values():
                lora.mask = mask.view(-1, 1) if task.is_alora else None
            hidden = train_forward(model, ids)
            picked = labels.view(-1) >= 0
            logits = model.output(hidden.view(-1, hidden.shape[-1])[picked])
            loss = F.cross_entropy(logits.float(), labels.view(-1)[picked])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 0 or step == steps - 1:
                print(f"  {task.name} step {step:3d} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    finally:
        for i, blk in enumerate(model.blk):
            for name in TARGETS:
                setattr(blk, name, wrapped[f"blk.{i}.{name}.weight"].base)
    return {target: (lora.a.detach().numpy().copy(), lora.b.detach().numpy().copy()) for target, lora in wrapped.items()}


def write_gguf_adapter(path: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]], task: Task, invocation: list[int] | None) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", ALPHA)
    writer.add_string("adapter.lora.task_name", task.name)
    writer.add_string("adapter.lora.prompt_prefix", task.prompt_prefix)
    writer.add_string("general.description", task.description)
    if invocation is not None:
        writer.add_key_value("adapter.alora.invocation_tokens", invocation, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    for target, (a, b) in pairs.items():
        writer.add_tensor(f"{target}.lora_a", a.astype(np.float16))
        writer.add_tensor(f"{target}.lora_b", b.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_peft(directory: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]], num_heads: int, num_kv_heads: int) -> None:
    """PEFT layout: HF module names, q/k rows of B back in HF's rotate-half order."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for target, (a, b) in pairs.items():
        _, layer, name, _ = target.split(".")
        if name in ("attn_q", "attn_k"):
            heads = num_heads if name == "attn_q" else num_kv_heads
            b = _unpermute_rows(b, heads)
        key = f"base_model.model.model.layers.{layer}.{HF_MODULES[name]}"
        tensors[f"{key}.lora_A.weight"] = a.astype(np.float16)
        tensors[f"{key}.lora_B.weight"] = b.astype(np.float16)
    header: dict[str, object] = {}
    offset = 0
    for key, array in tensors.items():
        header[key] = {"dtype": "F16", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(directory / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj", "o_proj"],
              "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "bias": "none", "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (adjacent pairs -> HF rotate-half)."""
    index = permute_rows_for_adjacent_rope(np.arange(rows.shape[0]), num_heads)
    out = np.empty_like(rows)
    out[index] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(TASKS), help="comma-separated adapters to train")
    parser.add_argument("--steps", type=int, help="optimizer steps per adapter (default: each adapter's own, 100-250)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = ModelRunner.from_paths(default_model_path(), [], DeviceConfig(weights="dense"))
    tokenizer = GGUFTokenizer(runner.base)
    questions = prompts(TRAIN_TOPICS)
    print(f"base answers for {len(questions)} prompts...", file=sys.stderr)
    answers = base_answers(runner, tokenizer, questions)
    for name in args.only.split(","):
        task = TASKS[name]
        data = examples(task, tokenizer, questions, answers)
        started = time.perf_counter()
        pairs = train(runner, task, data, args.steps or task.steps, args.batch_size, seed=len(name))
        invocation = tokenizer.encode(INVOCATION, add_special=False, parse_special=True) if task.is_alora else None
        write_gguf_adapter(args.out / f"{name}.gguf", pairs, task, invocation)
        print(f"{name}: trained in {time.perf_counter() - started:.0f} s -> {args.out / f'{name}.gguf'}", file=sys.stderr)
        if name == "caps":
            hp = runner.hparams
            write_peft(args.out / "caps-peft", pairs, hp.num_heads, hp.num_kv_heads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
