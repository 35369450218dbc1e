"""Real ``ksana serve`` processes on loopback, started once and shared, and small helpers to read them."""

from __future__ import annotations

import time

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ksana.server.process import ServeProcess

STARTUP_TIMEOUT_S = 90.0


class ServerProcess(ServeProcess):
    """A ``ksana serve`` child process with an HTTP client and /metrics readers for the tests."""

    def __init__(self, *args: str) -> None:
        super().__init__(*args, startup_timeout_s=STARTUP_TIMEOUT_S)
        self.client: httpx2.Client | None = None

    def wait_ready(self) -> ServerProcess:
        super().wait_ready()
        if self.client is None:
            self.client = httpx2.Client(base_url=self.url, timeout=60)
        return self

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name (labels are not used by this server)."""
        response = self.client.get("/metrics")
        response.raise_for_status()
        return {sample.name: sample.value for family in text_string_to_metric_families(response.text)
                for sample in family.samples}

    def wait_metrics(self, condition, timeout_s: float = 10.0) -> dict[str, float]:
        """Poll /metrics until ``condition(metrics)`` holds; fail with the last values after the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = self.metrics()
            if condition(values):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics condition not met within {timeout_s} s: {values}")
            time.sleep(0.01)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        super().close(timeout_s=10)


@pytest.fixture(scope="session")
def server():
    """The demo model with default settings, shared by every server test; float32 on any device (the default
    on the CPU), so that the tests' references in float32 hold on a GPU too."""
    process = ServerProcess("--model", "demo", "--dtype", "float32")
    import ksana.llm  # noqa: F401  (the heavy imports overlap with the server's start-up)

    yield process.wait_ready()
    process.close()


@pytest.fixture(scope="session")
def demo_llm():
    """The offline engine on the same model: the reference the server's greedy streams must equal."""
    from ksana import LLM

    return LLM(model="demo", dtype="float32")
