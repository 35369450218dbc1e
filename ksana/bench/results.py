"""How every benchmark writes its result JSON, so they all read the same way (``bench/results/*.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


def write_json(report: Any, out: Path | str, *, options: int = 0) -> Path:
    """``report`` as indented JSON at ``out`` (its folder made if missing), announced on stdout. ``options``: more
    orjson flags, for reports holding numpy values or non-string keys."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | options))
    print(f"wrote {out}")
    return out
