"""Mistral: Llama with ``sliding_window`` on every layer (when set)."""

from __future__ import annotations

from typing import Any

from ksana.models.decoder import Biases, DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def _biases(cls, config: Any) -> Biases:
        return Biases()
