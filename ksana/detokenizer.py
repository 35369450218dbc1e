"""Incremental detokenization: stream a request's output text as tokens arrive, in O(window) per append.

The prefix-offset / read-offset technique (vLLM, TGI): decode a small window of already-emitted tokens
(`ids[prefix_offset:read_offset]`) and the same window plus the new tokens (`ids[prefix_offset:]`); the new text
is the difference. Decoding with left context keeps decoders that treat the first token specially (leading-space
stripping) and byte-level merges consistent, and text that ends in U+FFFD (a multi-byte character cut between
tokens) is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers

_REPLACEMENT_CHAR = "\ufffd"


def raw_tokenizer(tokenizer: Any) -> tokenizers.Tokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` whose ``decode`` equals ``tokenizer``'s (without the clean-up), or None.

    A ``transformers`` fast tokenizer's ``decode`` is its backend's ``decode`` behind a Python wrapper that costs
    several times the decode itself; each streamed token decodes twice, so the wrapper is skipped when the class
    keeps the stock ``_decode`` (a subclass that overrides it keeps the wrapper).
    """
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as stock
    except ImportError:  # transformers 4: the fast base class under its old name
        try:
            from transformers import PreTrainedTokenizerFast as stock
        except ImportError:
            return None
    if getattr(type(tokenizer), "_decode", None) is not stock._decode:
        return None
    return backend


class IncrementalDetokenizer:
    """Accumulates one request's output text; the sum of `append` deltas plus `flush` is `decode(output_ids)`.

    `prompt_token_ids` is accepted for vLLM-shaped call sites but gives no context: the first window starts at
    the first output token, so the text equals `tokenizer.decode(output_ids)` exactly, as HF's `generate` +
    `decode(output[len(prompt):])` gives (with prompt context a SentencePiece tokenizer would add a leading space).
    Decoding never applies `clean_up_tokenization_spaces`, which is not local and so cannot be streamed.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._raw = raw_tokenizer(tokenizer)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(output_token_ids[prefix_offset:read_offset]), kept until they move
        # The text so far, extended per emit: one copy of the text each time, where joining a list of chunks on
        # each read (the output processor reads it per token) costs a pass over every chunk.
        self._text = ""

    @property
    def text(self) -> str:
        """All output text finalised so far (the sum of the deltas returned)."""
        return self._text

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose text is held back (an unfinished multi-byte character)."""
        return len(self.output_token_ids) - self._read_offset

    def append(self, token_ids: Sequence[int]) -> str:
        """Add new output tokens and return the newly finalised text ("" while a character is incomplete)."""
        self.output_token_ids.extend(token_ids)
        if not token_ids:
            return ""
        new_text = self._decode(self.output_token_ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(self._prefix_text):
            # An incomplete character (or tokens that decode to nothing, e.g. skipped special tokens): wait.
            return ""
        return self._emit(new_text[len(self._prefix_text) :])

    def flush(self) -> str:
        """Return the held-back text as it decodes now (U+FFFD for a truncated character); call once at the end."""
        if self._read_offset == len(self.output_token_ids):
            return ""
        new_text = self._decode(self.output_token_ids[self._prefix_offset :])
        return self._emit(new_text[len(self._prefix_text) :])

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.output_token_ids)
        self._prefix_text = self._decode(self.output_token_ids[self._prefix_offset : self._read_offset])
        self._text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self._raw is not None:
            return self._raw.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
