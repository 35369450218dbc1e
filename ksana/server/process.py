"""``ksana serve`` as a child process on loopback: what the server tests and the serving benchmarks drive.

The server picks a free port (``--port 0``) and prints one line with its URL once it is ready; ``wait_ready``
reads that line (with a deadline, so a server that dies or hangs at start-up fails with its log instead of
blocking). stderr goes to a temporary log file, removed on ``close``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


class ServeProcess:
    """``python -m ksana.cli serve --port 0 <args>``; ``url`` is set by ``wait_ready``."""

    COMMAND = "serve"  # the ``ksana`` subcommand; it prints "... at http://HOST:PORT" once it listens

    def __init__(self, *args: str, startup_timeout_s: float = 90.0) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.log = tempfile.NamedTemporaryFile(prefix=f"ksana-{self.COMMAND}-", suffix=".log", delete=False)
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("KSANA_API_KEY", None)  # a key in the caller's shell must not leak into these servers
        self.proc = subprocess.Popen(self.command(*args), stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.url = ""

    def command(self, *args: str) -> list[str]:
        # -P: the working directory stays off sys.path, so a checkout's top-level folders (``kernels/``) cannot
        # shadow installed distributions of the same name (Hugging Face's ``kernels``, which transformers imports)
        return [sys.executable, "-P", "-m", "ksana.cli", "--log-level", "WARNING", self.COMMAND, "--port", "0", *args]

    def wait_ready(self) -> ServeProcess:
        if not self.url:
            self.url = self._read_url()
        return self

    def _read_url(self) -> str:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.startup_timeout_s)
        text = line[0] if line else ""
        if " at http://" not in text:
            self.proc.kill()
            raise RuntimeError(f"ksana {self.COMMAND} did not start (printed {text!r}):\n{self.logs()}")
        return text.rsplit(" at ", 1)[1].strip()

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop it (``stop_process``), then drop the log."""
        stop_process(self.proc, timeout_s)
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> ServeProcess:
        return self.wait_ready()

    def __exit__(self, *exc_info) -> None:
        self.close()


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a server's graceful shutdown), SIGKILL if it outlives ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
