"""Prefill/decode disaggregation tests, and the polling they share."""

from __future__ import annotations

import time


def wait_for(condition, what: str, timeout_s: float = 60.0):
    """Poll ``condition()`` until it is truthy (its value is returned); fail naming ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
