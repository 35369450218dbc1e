"""run_in_fresh_thread: the call happens on a new thread that is gone afterwards; results and errors come back."""

from __future__ import annotations

import threading

import pytest

from ksana.worker.fresh_thread import run_in_fresh_thread


def test_runs_on_a_new_thread_that_ends_and_returns_the_result():
    seen: list[threading.Thread] = []

    def work(a: int, b: int = 0) -> int:
        seen.append(threading.current_thread())
        return a + b

    assert run_in_fresh_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_reraises_the_error_in_the_caller():
    def fail() -> None:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        run_in_fresh_thread(fail)
