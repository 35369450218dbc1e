"""Tokenizer loading through ``transformers.AutoTokenizer`` (offline: no hub is reachable)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none: the engine then takes token ids only (like vLLM's
    ``skip_tokenizer_init``) and returns no text."""
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", model_dir)
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
