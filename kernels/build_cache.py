"""Ksana's on-disk cache (built models, compiled kernels), and how to build an entry there exactly once.

A built entry appears under its final name only when complete (built in a temporary directory beside
it, then renamed), so a reader never sees half a build; a file lock serialises builders, so two processes that
race build it once and both get the same directory. It lives with the kernels because they are its lowest user.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "KSANA_CACHE_DIR"


def ksana_cache_dir() -> Path:
    """The cache root: ``$KSANA_CACHE_DIR`` if set, else ``~/.cache/ksana`` (read at each call, so tests can move it)."""
    root = os.environ.get(CACHE_DIR_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "ksana"


def build_cached(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``<cache root>/<name>``, calling ``build(tmp_dir)`` to fill it the first time.

    ``build`` writes into an empty temporary directory on the same filesystem; on success it is renamed into place,
    on failure it is removed and the error propagates. Later calls (and racing processes, once the winner is done)
    return at once.
    """
    target = ksana_cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{name}.lock"
    with open(lock_path, "a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if target.is_dir():  # another process built it while we waited for the lock
                return target
            tmp_dir = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
            try:
                build(tmp_dir)
                _make_readable(tmp_dir)
                os.replace(tmp_dir, target)
            except BaseException:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
            logger.info("built %s", target)
            return target
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create private files; a model directory is ordinary shared data."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
