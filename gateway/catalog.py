"""What a deployment serves, as the gateway sees it (torch-free): the base model's
name, tokenizer, chat template and context, and every adapter's metadata and
content fingerprint. Read from the GGUF files' metadata; no weights are loaded
beyond the adapters' own small tensors (for their fingerprints)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from gateway.config import ServeConfig
from gateway.reasoning import tags_of
from gateway.tool_calls import template_style
from worker.contract.spec import slot_length
from worker.formats.adapter import load_adapter
from worker.formats.fingerprint import adapter_set_fingerprint, base_fingerprint
from worker.formats.gguf_file import GGUFFile
from worker.formats.grammar import check, ll_tokenizer
from worker.formats.hparams import ModelHParams
from worker.formats.tokenizer import GGUFTokenizer


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    fingerprint: str
    task_name: str | None
    prompt_prefix: str | None
    invocation_tokens: tuple[int, ...] | None
    owner: str = ""  # the tenant that registered it; "" for shared ones (the config's, the operator's)
    is_dora: bool = False  # a DoRA adapter: never stacked with another in one request
    chat_template: str | None = None  # its own (adapter.chat_template): its requests render with it, not the base's

    @property
    def is_alora(self) -> bool:
        return self.invocation_tokens is not None


class Catalog:
    def __init__(self, config: ServeConfig) -> None:
        self.model_path = config.model_path()
        self.base = GGUFFile(self.model_path)
        self.model_name = config.model_name or self.model_path.name.removesuffix(".gguf")
        self.hparams = ModelHParams.from_gguf(self.base)
        self.tokenizer = GGUFTokenizer(self.base)
        self.tool_style = template_style(self.tokenizer.chat_template)  # how chat tools reach this model (gateway/tool_calls.py)
        # the thinking markers answers are split on (gateway/reasoning.py)
        self.reasoning_tags = tags_of(config.reasoning.parser, self.tokenizer.chat_template)
        self.default_thinking = config.reasoning.default_thinking  # the template's enable_thinking when a request does not say
        self.max_positions = slot_length(config.engine.slot_len, self.hparams.context_length)
        # a text longer than this cannot fit the context whatever it says: refused before tokenizing
        self.longest_token_chars = max(1, max((len(self.tokenizer.token_text(i)) for i in range(self.tokenizer.vocab_size)), default=1))
        self.max_prompt_chars = self.max_positions * self.longest_token_chars
        self.base_fingerprint = base_fingerprint(self.base, config.fingerprint_path())
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, for checking grammars
        self._ll_lock = threading.Lock()
        self.adapters: dict[str, AdapterInfo] = {}
        for entry in config.adapters:
            path = config.resolve(entry.path)
            adapter = load_adapter(path, self.base)  # AdapterError: the deployment does not start
            self.adapters[entry.name] = AdapterInfo(
                entry.name, path, adapter.fingerprint, adapter.task_name, adapter.prompt_prefix, adapter.invocation_tokens,
                is_dora=adapter.is_dora, chat_template=adapter.chat_template,
            )

    def check_grammar(self, grammar: str) -> None:
        """GrammarError when the model cannot be made to follow `grammar` (the tokenizer is built once;
        called from worker threads)."""
        with self._ll_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.hparams.vocab_size)
        check(grammar, self._ll_tokenizer)

    def adapter_set_fingerprint(self, scales: dict[str, float]) -> str:
        """Of the adapters (fingerprint -> scale) on this base."""
        return adapter_set_fingerprint(self.base_fingerprint, list(scales.items()))
