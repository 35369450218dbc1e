"""Real ``ksana serve`` processes on loopback, started once and shared, and small helpers to read them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90.0


class ServerProcess:
    """``python -m ksana.cli serve --port 0 ...``; the URL comes from the line the server prints once ready."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="ksana-serve-", suffix=".log", delete=False)
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("KSANA_API_KEY", None)  # a key in the developer's shell must not leak into these servers
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ksana.cli", "--log-level", "WARNING", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO, env=env,
        )
        self.url = ""
        self.client: httpx2.Client | None = None

    def wait_ready(self) -> ServerProcess:
        if self.url:
            return self
        self.url = self._read_url()
        self.client = httpx2.Client(base_url=self.url, timeout=60)
        return self

    def _read_url(self) -> str:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(STARTUP_TIMEOUT_S)
        text = line[0] if line else ""
        if " at http://" not in text:
            self.proc.kill()
            raise RuntimeError(f"server did not start (printed {text!r}):\n{self.logs()}")
        return text.rsplit(" at ", 1)[1].strip()

    def logs(self) -> str:
        return Path(self.log.name).read_text()

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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def server():
    """The demo model with default settings, shared by every server test."""
    process = ServerProcess("--model", "demo")
    import ksana.llm  # noqa: F401  (the heavy imports overlap with the server's start-up)

    yield process.wait_ready()
    process.close()


@pytest.fixture(scope="session")
def demo_llm():
    """The offline engine on the same model: the reference the server's greedy streams must equal."""
    from ksana import LLM

    return LLM(model="demo")
