"""Stop strings over streamed pieces of text."""

from __future__ import annotations

from worker.engine.stop import StopMatcher


def feed_all(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush(), matcher.is_stopped


def test_stop_split_over_pieces_is_never_emitted() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("abc E") == "abc "
    assert matcher.feed("N") == ""
    assert matcher.feed("Dxyz") == ""
    assert matcher.is_stopped and matcher.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    assert feed_all(["END"], ["abc E", "NX", "yz"]) == ("abc ENXyz", False)
    assert feed_all(["END"], ["abc EN"]) == ("abc EN", False)  # flushed at the end


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", True)
    assert feed_all(["\n\n", "###"], ["a\n", "\nb###"]) == ("a", True)


def test_no_stops_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == "abc" and not matcher.is_stopped


def test_the_stop_string_found_is_remembered_the_earliest_and_then_the_longest() -> None:
    matcher = StopMatcher(["lo w", "o", "hello"])
    assert matcher.feed("hel") == ""  # "hel" may start "hello": held back
    matcher.feed("lo world")
    assert matcher.is_stopped and matcher.matched == "hello"
    other = StopMatcher(["b", "ab"])
    assert other.feed("xab") == "x" and other.matched == "ab"
    assert StopMatcher(["q"]).matched is None
