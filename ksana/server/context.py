"""What every route handler needs: the I/O actor, the tokenizer, the model's limits and the server's options."""

from __future__ import annotations

import itertools
import random
import secrets
import time
from pathlib import Path
from typing import Any

import attrs

from ksana.server.io_actor import ServerIOActor
from ksana.server.metrics import ServerMetrics
from ksana.server.protocol import APIError, ChatMessage, bad_request


@attrs.define(eq=False)
class ServerContext:
    io: ServerIOActor
    metrics: ServerMetrics
    tokenizer: Any  # a transformers tokenizer, or None for a token-ids-only model directory
    served_model_name: str
    model_dir: Path
    max_token_len: int  # a prompt must be shorter than this (the scheduler's effective limit)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    api_key: str | None = None
    stream_interval: int = 1  # tokens per streamed event (``ServeOptions.stream_interval``)
    node_role: str = "none"  # prefill/decode disaggregation: "prefill" or "decode" (``server/disagg.py``)
    kv_connector: Any = None  # a prefill or decode node's KV transport, for /metrics
    # The model's sampling defaults (``--generation-config``): what a request that leaves a field out gets.
    default_sampling: dict[str, Any] = attrs.field(factory=dict)
    created: int = attrs.field(factory=lambda: int(time.time()))
    rng: random.Random = attrs.field(factory=random.Random)
    _counter: Any = attrs.field(factory=itertools.count)
    _token_texts: dict[int, str] = attrs.field(factory=dict)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(6)}{next(self._counter)}"

    def new_seed(self) -> int:
        return self.rng.getrandbits(62)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    # ---- prompts ----------------------------------------------------------------------------------------------
    def encode_text(self, text: str, param: str = "prompt", add_special_tokens: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids instead of text", param=param)
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer(text, add_special_tokens=add)["input_ids"])

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer, so it has no chat template", param="messages")
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            encoded = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True,
                **(template_kwargs or {}))
        except Exception as exc:  # a template error is the caller's input (e.g. a role the template refuses)
            raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from None
        return list(encoded["input_ids"])

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        """Reject an empty or too long prompt, or ids outside the vocabulary, before it reaches the scheduler."""
        if not token_ids:
            raise bad_request("the prompt is empty", param=param)
        if len(token_ids) >= self.max_token_len:
            raise bad_request(
                f"the prompt has {len(token_ids)} tokens; this model's maximum is {self.max_token_len - 1} "
                f"(max_token_len {self.max_token_len})", param=param, code="context_length_exceeded")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        return token_ids

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """A requested output limit that the context cannot hold after the prompt is a 400 (vLLM's wording):
        clients trim their history on it rather than get a shorter answer than they asked for."""
        if max_tokens is None or num_prompt_tokens + max_tokens <= self.max_token_len:
            return
        raise bad_request(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is {self.max_token_len} "
            f"tokens and your request has {num_prompt_tokens} input tokens ({max_tokens} > {self.max_token_len} - "
            f"{num_prompt_tokens}).", param=param, code="context_length_exceeded")

    def check_stop_token_ids(self, token_ids: list[int] | None, param: str = "stop_token_ids") -> None:
        bad = next((t for t in token_ids or () if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"stop_token_ids has token id {bad}, outside the vocabulary [0, {self.vocab_size}) "
                              f"(vocabulary size {self.vocab_size})", param=param)

    # ---- text of tokens ---------------------------------------------------------------------------------------
    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """One token's own text, as logprobs show it (special tokens included), or ``token_id:<id>``."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_texts.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                    else f"token_id:{token_id}")
            self._token_texts[token_id] = text
        return text
