from hypothesis import given, settings
from hypothesis import strategies as st

from ksana.stop_checker import StopChecker, StopMatch


def test_stop_string_is_cut():
    checker = StopChecker(["END"])
    text = "hello END world"
    match = checker.check(text, num_new_chars=len(text))
    assert match == StopMatch(truncate_to=6, stop="END")
    assert text[: match.truncate_to] == "hello "


def test_no_match_returns_none():
    checker = StopChecker(["END", "\n\n"])
    assert checker.check("hello world\n", num_new_chars=3) is None
    assert StopChecker([]).check("anything", 8) is None
    assert StopChecker([""]).check("anything", 8) is None  # an empty stop string would match everywhere


def test_earliest_match_wins_regardless_of_list_order():
    checker = StopChecker(["zz", "b", "ab"])
    text = "xxabzz b"
    assert checker.check(text, num_new_chars=len(text)) == StopMatch(truncate_to=2, stop="ab")
    # Same start: the truncation is the same; the first listed string is reported.
    assert StopChecker(["abc", "ab"]).check("xabc", 4) == StopMatch(truncate_to=1, stop="abc")


def test_stop_string_split_across_two_appends():
    checker = StopChecker(["</answer>"])
    text = "the result is 42</ans"
    assert checker.check(text, num_new_chars=5) is None
    text += "wer> trailing"
    match = checker.check(text, num_new_chars=len("wer> trailing"))
    assert match == StopMatch(truncate_to=len("the result is 42"), stop="</answer>")


def test_match_wholly_in_old_text_is_not_reported_again():
    checker = StopChecker(["ab"])
    assert checker.check("ab then more", num_new_chars=4) is None
    assert checker.check("ab then ab", num_new_chars=1) == StopMatch(truncate_to=8, stop="ab")


def test_search_is_limited_to_the_tail():
    """The search starts near the end, so a step costs O(new + max stop length), not O(len(text))."""

    class Recording(str):
        starts: list[int] = []

        def find(self, sub, start=0, *args):
            Recording.starts.append(start)
            return super().find(sub, start, *args)

    checker = StopChecker(["STOP", "xy"])
    text = Recording("a" * 10_000 + "bcd")
    assert checker.check(text, num_new_chars=3) is None
    assert min(Recording.starts) >= len(text) - 3 - len("STOP") + 1


def test_safe_prefix_len_holds_back_only_a_genuine_partial_match():
    checker = StopChecker(["</answer>", "STOP"])
    assert checker.safe_prefix_len("hello </ans") == len("hello ")
    assert checker.safe_prefix_len("hello ST") == len("hello ")
    assert checker.safe_prefix_len("hello S") == len("hello ")
    assert checker.safe_prefix_len("hello <") == len("hello ")
    assert checker.safe_prefix_len("hello </x") == len("hello </x")  # diverged: nothing to hold
    assert checker.safe_prefix_len("hello TO") == len("hello TO")  # not a prefix of any stop string
    assert checker.safe_prefix_len("hello") == 5
    assert checker.safe_prefix_len("") == 0
    assert StopChecker([]).safe_prefix_len("abc") == 3


def test_safe_prefix_len_takes_the_longest_partial_match():
    checker = StopChecker(["aab", "ab"])
    assert checker.safe_prefix_len("xaa") == 1  # "aa" begins "aab"
    assert checker.safe_prefix_len("xa") == 1


def partial_match_len(stops, text):
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=3),
    pieces=st.lists(st.text(alphabet="abc", max_size=4), max_size=12),
)
def test_streaming_agrees_with_searching_the_whole_text(stops, pieces):
    """After every append the check agrees with a plain search of the text so far, and what safe_prefix_len
    lets through is never taken back by a later cut."""
    checker = StopChecker(stops)
    text, streamed = "", 0
    for piece in pieces:
        text += piece
        match = checker.check(text, len(piece))
        found = [text.find(s) for s in checker.stop if s in text]
        if found:
            assert match is not None
            assert match.truncate_to == min(found)
            assert text.startswith(match.stop, match.truncate_to)
            assert streamed <= match.truncate_to
            break
        assert match is None
        safe = checker.safe_prefix_len(text)
        assert safe == len(text) - partial_match_len(checker.stop, text)
        assert safe >= streamed
        streamed = safe
