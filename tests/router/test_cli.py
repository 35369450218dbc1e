"""``ksana router``'s flags as a user meets them, the storage URL, and the request ids both nodes get."""

from __future__ import annotations

import socket
import subprocess
import sys
import zlib
from pathlib import Path

from ksana.router.proxy import RequestIds
from ksana.router.storage import database_url


def _ksana(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "ksana.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_bad_flags_are_refused_with_their_name():
    proc = _ksana("router", "--policy", "round_robin")
    assert proc.returncode == 2 and "--policy: invalid choice: 'round_robin'" in proc.stderr
    proc = _ksana("router", "--heartbeat-timeout", "0")
    assert proc.returncode == 2 and "--heartbeat-timeout: takes a number of seconds above 0, not '0'" in proc.stderr


def test_a_port_in_use_is_a_message_not_a_traceback(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _ksana("router", "--port", str(port), "--db", str(tmp_path / "r.db"))
    assert proc.returncode == 2
    assert f"ksana: error: cannot serve on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr


def test_db_is_a_sqlite_path_or_a_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert database_url("router.db") == f"sqlite:///{Path(tmp_path, 'router.db').resolve()}"
    assert database_url("/var/lib/router.db") == "sqlite:////var/lib/router.db"
    for url in ("postgresql://router@db/ksana", "mysql+pymysql://u:p@db:3306/ksana", "sqlite:///x.db"):
        assert database_url(url) == url


def test_request_ids_are_kv_comm_request_ids():
    ids = RequestIds(pid=4242)
    first, second = ids.next(), ids.next()
    assert first == zlib.crc32(b"4242:110") & 0x7FFFFFFF
    assert second == zlib.crc32(b"4242:111") & 0x7FFFFFFF
    assert 0 < first < 2**31 and first != second
