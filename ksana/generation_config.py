"""The model's own sampling defaults, from its ``generation_config.json`` (vLLM's ``--generation-config``).

Model makers put their recommended settings there (SmolLM2-Instruct: temperature 0.2, top_p 0.9); a request that
leaves a sampling field out should get them rather than the API's neutral defaults (temperature 1), which make a
small model wander. ``auto`` reads the model directory's file, ``vllm`` ignores it, and any other value is a
directory whose ``generation_config.json`` is read instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ksana.sampling_params import SamplingParams, SamplingParamsError

# generation_config.json key -> SamplingParams field (vLLM reads the same keys; do_sample is not one of them).
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_sampling_defaults(model_dir: Path, source: str = "auto") -> dict[str, Any]:
    """The ``SamplingParams`` fields the generation config sets, checked as ``SamplingParams`` checks them."""
    if source == "vllm":
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise FileNotFoundError(f"--generation-config {source}: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    defaults = {field: data[key] for key, field in _FIELDS.items() if data.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (SamplingParamsError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return defaults
