"""The n-gram drafter: the continuation of the longest matching tail, the latest occurrence first."""

from __future__ import annotations

from worker.engine.speculative.ngram import NgramIndex


def test_the_longest_tail_found_before_gives_what_followed_it() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # tail (1, 2, 3) occurred at 0: what followed is 4, 5, 9; the later (2, 3) at 6 is a shorter match
    assert index.draft(tokens, 3) == [4, 5, 9]
    assert index.draft(tokens, 10) == tokens[3:]  # as much as followed, up to the end


def test_a_shorter_tail_and_the_latest_occurrence() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [5, 1, 6, 2, 1, 7, 3, 1]
    assert index.draft(tokens, 2) == [7, 3]  # (3, 1) and (7, 3, 1) are new; (1,) last seen at 4
    assert NgramIndex(min_n=2, max_n=3).draft(tokens, 2) == []  # no tail of 2 or more tokens occurred before


def test_the_index_follows_the_sequence_as_it_grows() -> None:
    index = NgramIndex(min_n=2, max_n=2)
    tokens = [1, 2, 3]
    assert index.draft(tokens, 4) == []
    tokens += [1, 2]
    assert index.draft(tokens, 4) == [3, 1, 2]
    tokens += [4, 1, 2]  # (1, 2) now last followed by 4
    assert index.draft(tokens, 2) == [4, 1]


def test_nothing_to_draft_from_one_token_or_no_room() -> None:
    index = NgramIndex(min_n=1, max_n=4)
    assert index.draft([3], 4) == []
    assert NgramIndex(1, 4).draft([3, 3], 0) == []
