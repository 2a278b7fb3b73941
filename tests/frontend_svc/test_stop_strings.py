"""Stop strings over streamed text: exact cuts across delta boundaries, nothing past a stop
ever released, and the same result however the text is cut into deltas."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from frontend_svc.stop_strings import StopStringMatcher


def run(deltas: list[str], stop: list[str], include: bool = False) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stop, include)
    released = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        released.append(text)
        if matched is not None:
            return "".join(released), matched
    return "".join(released) + matcher.flush(), None


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """On the whole text: the stop string that ends first (the longest on a tie)."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stop if s and s in text]
    if not found:
        return text, None
    end, _, matched = min(found)
    return text[: end if include else end - len(matched)], matched


def test_a_stop_string_across_deltas_cuts_exactly() -> None:
    assert run(["Hello wo", "rld, and more"], ["world"]) == ("Hello ", "world")
    assert run(["Hello wo", "rld, and more"], ["world"], include=True) == ("Hello world", "world")


def test_text_that_may_become_a_stop_string_is_held_back() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("O") == ("", None)
    assert matcher.feed("P!") == ("", "STOP")
    assert matcher.feed("more") == ("", None)  # nothing after a match


def test_a_false_start_is_released_when_it_cannot_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == ("", None)
    assert matcher.feed("ART") == ("START", None)
    assert matcher.flush() == ""


def test_the_held_tail_comes_out_at_the_end() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", None)
    assert matcher.flush() == "</ans"


def test_the_first_stop_string_to_complete_wins() -> None:
    assert run(["xabcd"], ["bcd", "ab"]) == ("x", "ab")
    assert run(["xab", "cd"], ["bcd", "ab"]) == ("x", "ab")
    assert run(["xabc"], ["abc", "bc"]) == ("x", "abc")  # same end: the longer one


def test_no_stop_strings_releases_everything_at_once() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)


@given(
    text=st.text(alphabet="abcSTOP世😀 ", max_size=60),
    stop=st.lists(st.text(alphabet="abcSTOP世😀 ", min_size=1, max_size=5), max_size=4),
    cuts=st.lists(st.integers(0, 60), max_size=10),
    include=st.booleans(),
)
def test_any_cut_into_deltas_gives_the_result_on_the_whole_text(
    text: str, stop: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(deltas, stop, include) == reference(text, stop, include)
