"""The reasoning splitter and the choice of markers (gateway/reasoning.py): pure, no model."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.reasoning import (
    THINK,
    ReasoningCounter,
    ReasoningPlan,
    ReasoningSplitter,
    opens_thinking,
    split_reasoning,
    tags_of,
    thinking_asked,
)

QWEN3 = "<think>\nFirst, 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4."


def streamed(text: str, sizes: list[int], starts_inside: bool = False) -> tuple[str, str, bool]:
    """`text` fed in pieces of these sizes (cycled), joined back: (reasoning, content, has_reasoning)."""
    splitter = ReasoningSplitter(THINK, starts_inside)
    reasoning, content, at, i = "", "", 0, 0
    while at < len(text):
        r, c = splitter.feed(text[at:at + sizes[i % len(sizes)]])
        reasoning, content, at, i = reasoning + r, content + c, at + sizes[i % len(sizes)], i + 1
    r, c = splitter.finish()
    return reasoning + r, content + c, splitter.has_reasoning


def test_a_qwen3_answer_splits_into_its_thinking_and_its_answer() -> None:
    assert split_reasoning(QWEN3, THINK) == ("First, 2 + 2.\nThat is 4.", "The answer is 4.")


@pytest.mark.parametrize("sizes", [[1], [2], [3], [5, 1], [7], [1, 8, 2]])
def test_streamed_in_any_pieces_it_splits_as_the_whole(sizes) -> None:
    # every marker is split across pieces by one of these
    assert streamed(QWEN3, sizes) == ("First, 2 + 2.\nThat is 4.", "The answer is 4.", True)


def test_an_answer_without_thinking_is_all_content_and_keeps_its_whitespace() -> None:
    assert split_reasoning("  Hello <think> there", THINK) == (None, "  Hello <think> there")
    assert streamed("  Hello <think> there", [1]) == ("", "  Hello <think> there", False)
    assert split_reasoning("<thi", THINK) == (None, "<thi")  # a marker's beginning that never completes is text


def test_an_answer_that_begins_inside_thinking_deepseek_r1_style() -> None:
    assert split_reasoning("I ponder.\n</think>\n\nDone.", THINK, starts_inside=True) == ("I ponder.", "Done.")
    assert streamed("I ponder.\n</think>\n\nDone.", [2], starts_inside=True) == ("I ponder.", "Done.", True)


def test_unfinished_thinking_is_all_reasoning() -> None:
    assert split_reasoning("<think>\nstill going </thi", THINK) == ("still going </thi", "")
    assert split_reasoning("", THINK, starts_inside=True) == ("", "")


def test_an_empty_think_block_is_empty_reasoning() -> None:
    assert split_reasoning("<think>\n\n</think>\n\nHi", THINK) == ("", "Hi")


def test_the_counter_counts_the_tokens_of_the_thinking() -> None:
    counter = ReasoningCounter(ReasoningPlan(THINK))
    pieces = [("<think>", 1), ("a b", 2), ("</think>", 1), ("\n\n", 1), ("Hi", 1), (" there", 2)]
    out = [counter.feed(text, n, i == len(pieces) - 1) for i, (text, n) in enumerate(pieces)]
    assert "".join(r for r, _ in out) == "a b" and "".join(c for _, c in out) == "Hi there"
    assert counter.num_reasoning_tokens == 4  # the markers are thinking's; the blank line after them is not
    unsplit = ReasoningCounter(ReasoningPlan(THINK, is_split=False))
    assert unsplit.feed("<think>a</think>b", 3, True) == ("", "<think>a</think>b") and unsplit.num_reasoning_tokens == 0


def test_markers_come_from_the_template_or_the_config() -> None:
    assert tags_of("auto", "{{ '<think>' }}...{{ '</think>' }}") == THINK
    assert tags_of("auto", "{{ messages }}") is None
    assert tags_of("auto", None) is None
    assert tags_of("none", "<think></think>") is None
    assert tags_of("qwen3", None) == THINK and tags_of("deepseek_r1", "") == THINK


def test_a_request_turns_thinking_on_or_off() -> None:
    assert thinking_asked(None, None) is None  # the template's default
    assert thinking_asked(False, "high") is False  # enable_thinking wins
    assert thinking_asked("yes", "none") is False  # not a bool: effort decides
    assert thinking_asked(None, "minimal") is True
    assert thinking_asked(None, None, False) is False and thinking_asked(True, None, False) is True  # the server's default
    assert opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)


def test_the_config_names_a_parser_or_is_refused(tmp_path) -> None:
    base = {"model": "m.gguf", "shards": [{"name": "s"}], "auth": "none", "state": {"ephemeral": True}}
    assert parse_config({**base, "reasoning": {"parser": "qwen3"}}, tmp_path).reasoning.parser == "qwen3"
    assert parse_config(base, tmp_path).reasoning.parser == "auto"
    assert parse_config(base, tmp_path).reasoning.default_thinking is True
    assert parse_config({**base, "reasoning": {"thinking": "off"}}, tmp_path).reasoning.default_thinking is False
    with pytest.raises(ConfigError, match="reasoning.parser"):
        parse_config({**base, "reasoning": {"parser": "o1"}}, tmp_path)
    with pytest.raises(ConfigError, match="reasoning.budget"):
        parse_config({**base, "reasoning": {"budget": 3}}, tmp_path)
