"""Picks the model family from ``config.json`` and builds a loaded ``CausalLM``."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import torch

from ksana.models.base import CausalLM
from ksana.models.deepseek_v3 import DeepseekV3ForCausalLM
from ksana.models.llama import LlamaForCausalLM
from ksana.models.loader import load_weights
from ksana.models.mistral import MistralForCausalLM
from ksana.models.parallel import TPGroup
from ksana.models.qwen2 import Qwen2ForCausalLM

__all__ = ["MODEL_FAMILIES", "CausalLM", "load_model", "read_eos_token_ids"]

MODEL_FAMILIES: MappingProxyType[str, type[CausalLM]] = MappingProxyType(
    {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM,
     "deepseek_v3": DeepseekV3ForCausalLM}
)


def read_eos_token_ids(model_dir: Path, config) -> list[int]:
    """EOS ids of ``config.json`` and ``generation_config.json`` (which is what HF ``generate`` stops on)."""
    ids: list[int] = []
    sources = [getattr(config, "eos_token_id", None)]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token_id in [value] if isinstance(value, int) else value or []:
            if token_id not in ids:
                ids.append(int(token_id))
    return ids


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    tp: TPGroup | None = None,
) -> CausalLM:
    """Build the family named by ``config.json``'s ``model_type`` and load its weights onto ``device``
    (with ``tp``, only this tensor-parallel rank's shard)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config = AutoConfig.from_pretrained(model_dir)
    family = MODEL_FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(
            f"unsupported model_type {config.model_type!r} in {model_dir / 'config.json'}; "
            f"supported: {', '.join(sorted(MODEL_FAMILIES))}"
        )
    eos_token_ids = read_eos_token_ids(model_dir, config)
    if tp is None:
        model = family(config, dtype=dtype, device=device, eos_token_ids=eos_token_ids)
    else:
        model = family(config, dtype=dtype, device=device, eos_token_ids=eos_token_ids, tp=tp)
    load_weights(model, model_dir)
    model.pack_weights()
    return model.eval()
