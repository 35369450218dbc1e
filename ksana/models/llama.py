"""Llama: the base decoder; ``attention_bias`` (q/k/v/o) and ``mlp_bias`` as in the config."""

from __future__ import annotations

from typing import Any

from ksana.models.decoder import Biases, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def _biases(cls, config: Any) -> Biases:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return Biases(qkv=attention_bias, o=attention_bias, mlp=bool(getattr(config, "mlp_bias", False)))
