"""``ksana router`` as a child process on loopback, for the router's tests and the disaggregated benchmarks.

It listens on a free port (``--port 0``) and prints ``Ksana router at http://HOST:PORT`` once ready; ``wait_ready``
reads that line with a deadline. ``close`` stops it with SIGTERM (SIGKILL if it lingers), which leaves its
database in place: a ``RouterProcess`` started again on the same ``--db`` is the same router restarted.
"""

from __future__ import annotations

from ksana.server.process import ServeProcess


class RouterProcess(ServeProcess):
    """``python -P -m ksana.cli router --port 0 <args>``; ``url`` is set by ``wait_ready``."""

    COMMAND = "router"

    def __init__(self, *args: str, startup_timeout_s: float = 30.0) -> None:
        super().__init__(*args, startup_timeout_s=startup_timeout_s)
