"""Prompt lookup's proposals: the longest recurring suffix, its latest earlier occurrence, what followed it."""

from __future__ import annotations

from ksana.spec.ngram import propose_ngram
from ksana.spec.stats import SpecDecodingStats


def test_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 6, 2, 3]
    # "2 3" occurs at 1 and 6; the latest (6) is followed by 7 8 6.
    assert propose_ngram(tokens, 3, min_n=1, max_n=2) == [7, 8, 6]
    # A 3-token suffix "6 2 3" never occurred before: the 2-token one decides.
    assert propose_ngram(tokens, 3, min_n=2, max_n=3) == [7, 8, 6]


def test_longer_matches_win_over_later_shorter_ones():
    tokens = [4, 5, 6, 10, 11, 0, 5, 6, 20, 4, 5, 6]
    assert propose_ngram(tokens, 2, min_n=2, max_n=3) == [10, 11]  # "4 5 6" beats the later "5 6"
    assert propose_ngram(tokens, 2, min_n=2, max_n=2) == [20, 4]


def test_no_proposal_without_a_recurring_suffix_or_below_the_minimum():
    assert propose_ngram([1, 2, 3, 4, 5], 3, min_n=1, max_n=3) == []
    assert propose_ngram([1, 2, 1, 2], 3, min_n=3, max_n=4) == []
    assert propose_ngram([7], 3, min_n=1, max_n=2) == []
    assert propose_ngram([1, 2, 1, 2], 0, min_n=1, max_n=2) == []


def test_proposals_stop_at_the_end_of_the_sequence():
    assert propose_ngram([1, 2, 3, 1, 2], 5, min_n=2, max_n=2) == [3, 1, 2]


def test_stats_count_acceptance_by_position():
    stats = SpecDecodingStats()
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    stats.observe(0, 0)  # a plain decode row is not a verify row
    assert stats.num_verify_rows == 3
    assert (stats.spec_draft_token_num, stats.spec_draft_hit_num) == (8, 4)
    assert stats.acceptance_by_position == [2 / 3, 1 / 3, 1 / 2]
    assert stats.mean_accepted_length == 1 + 4 / 3
    assert stats.to_dict()["acceptance_rate"] == 0.5
