"""Qwen2: Llama with q/k/v biases; sliding windows per layer come from ``layer_types`` (see ModelShape)."""

from __future__ import annotations

from typing import Any

from ksana.models.decoder import Biases, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def _biases(cls, config: Any) -> Biases:
        return Biases(qkv=True)
