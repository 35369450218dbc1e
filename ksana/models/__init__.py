"""Model families (Llama, Qwen2, Mistral, DeepSeek-V3) over a paged KV cache, and their loader."""

from ksana.models.base import CausalLM
from ksana.models.registry import load_model
from ksana.models.shape import ModelShape

__all__ = ["CausalLM", "ModelShape", "load_model"]
