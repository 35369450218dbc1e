"""Run start-up tensor work on a short-lived thread, so the calling thread keeps no OpenMP pool.

libgomp keeps a pool of worker threads for every thread that has run a parallel region, and once its pools hold
more threads than the machine has CPUs it stops spinning between regions ("throttled" waits of 100 spins, which no
environment variable lifts): every region then starts by waking its workers through the kernel. The engine's forward
passes run on the forward lane's thread; if the thread that built the engine had filled the KV pool or loaded the
weights itself, its pool would stay and throttle every later region, which on a 2-core machine makes a small
model's decode step a third slower (``bench/roofline.py``'s decode steps show it). Start-up done here leaves no
pool behind: it goes with its thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new thread that ends with it; its result, or its exception re-raised here."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the caller as is
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"ksana-startup-{getattr(fn, '__name__', 'call')}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
