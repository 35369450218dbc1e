import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ksana.detokenizer import IncrementalDetokenizer, raw_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import PreTrainedTokenizerFast  # noqa: E402

CORPUS = [
    "The café serves a naïve crème brûlée. 日本語のテキストです。 emoji 🙂 and 🚀!",
    "Hello world, hello tokens; ça va? Grüße aus Köln. 東京 大阪 🙂🙂 naïve café",
    "Numbers 12345, symbols #@%&*, and   spaces\tand\nnewlines.",
] * 30
ALPHABET = "abcdeéïüß  .,!\n日本語東京🙂🚀𝄞Ωж"  # some characters are in the corpus, some (𝄞, Ω, ж) are not
EOS = "<|endoftext|>"
VOCAB_SIZE = 400


def train(pre_tokenizer, decoder) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS]
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style: '▁' marks spaces and the decoder strips the first token's leading space."""
    return train(pre_tokenizers.Metaspace(), decoders.Metaspace())


def stream(tokenizer, token_ids, chunk_sizes, skip_special_tokens=True):
    detok = IncrementalDetokenizer(
        tokenizer, prompt_token_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens
    )
    deltas, i, sizes = [], 0, iter(chunk_sizes)
    while i < len(token_ids):
        n = next(sizes, 1)
        deltas.append(detok.append(token_ids[i : i + n]))
        i += n
    return detok, deltas


chunk_sizes = st.lists(st.integers(1, 4), max_size=200)
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(text=st.text(alphabet=ALPHABET, max_size=80), sizes=chunk_sizes)
def test_deltas_of_valid_text_add_up_to_decode(byte_level, text, sizes):
    token_ids = byte_level.encode(text)
    detok, deltas = stream(byte_level, token_ids, sizes)
    assert "".join(deltas) == byte_level.decode(token_ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.num_pending_tokens == 0
    assert detok.flush() == ""


@SETTINGS
@given(
    token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=60),
    sizes=chunk_sizes,
    skip_special_tokens=st.booleans(),
)
def test_deltas_of_random_tokens_add_up_to_decode(byte_level, token_ids, sizes, skip_special_tokens):
    """Arbitrary ids include invalid UTF-8 and the special token; flush releases the held-back tail."""
    assert len(byte_level) == VOCAB_SIZE
    detok, deltas = stream(byte_level, token_ids, sizes, skip_special_tokens)
    deltas.append(detok.flush())
    expected = byte_level.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detok.text == expected


@SETTINGS
@given(text=st.text(alphabet=ALPHABET, max_size=80), sizes=chunk_sizes)
def test_leading_space_tokenizer(metaspace, text, sizes):
    token_ids = metaspace.encode(text)
    expected = metaspace.decode(token_ids)
    detok, deltas = stream(metaspace, token_ids, sizes)
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)


def test_character_split_across_tokens_is_held_back(byte_level):
    token_ids = byte_level.encode("a𝄞")  # 𝄞 is not in the corpus: four single-byte tokens
    assert len(token_ids) == 5
    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.append(token_ids[:1]) == "a"
    for token_id in token_ids[1:4]:
        assert detok.append([token_id]) == ""
    assert detok.num_pending_tokens == 3
    assert detok.append(token_ids[4:]) == "𝄞"
    assert detok.text == "a𝄞"


def test_truncated_character_is_flushed_as_replacement(byte_level):
    token_ids = byte_level.encode("a𝄞")[:3]
    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.append(token_ids) == ""  # text is released at token granularity: "a" waits too
    assert detok.flush() == byte_level.decode(token_ids)
    assert detok.text == byte_level.decode(token_ids)
    assert "\ufffd" in detok.text

    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.append(token_ids[:1]) == "a"
    assert detok.append(token_ids[1:]) == ""
    assert detok.flush() == byte_level.decode(token_ids)[1:]
    assert detok.text == byte_level.decode(token_ids)
    assert "\ufffd" in detok.text


def test_special_tokens_skipped_or_kept(byte_level):
    eos = byte_level.convert_tokens_to_ids(EOS)
    token_ids = byte_level.encode("café") + [eos]
    assert "".join(stream(byte_level, token_ids, [])[1]) == "café"
    assert "".join(stream(byte_level, token_ids, [], skip_special_tokens=False)[1]) == "café" + EOS


def test_works_with_a_raw_tokenizers_tokenizer(byte_level):
    raw = byte_level.backend_tokenizer
    token_ids = raw.encode("naïve 日本語 🙂").ids
    detok, deltas = stream(raw, token_ids, [])
    assert "".join(deltas) == "naïve 日本語 🙂"


class CountingTokenizer:
    """Records how many ids each decode call gets, to show an append costs O(window), not O(length)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.window_sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_append_decodes_a_small_window(byte_level):
    text = " ".join(CORPUS[:3]) * 10
    token_ids = byte_level.encode(text)
    assert len(token_ids) > 500
    counting = CountingTokenizer(byte_level)
    detok, deltas = stream(counting, token_ids, [])
    assert "".join(deltas) == text
    assert max(counting.window_sizes) <= 8


def test_fast_tokenizer_decodes_through_its_backend(byte_level):
    assert raw_tokenizer(byte_level) is byte_level.backend_tokenizer
    assert raw_tokenizer(byte_level.backend_tokenizer) is byte_level.backend_tokenizer
    assert raw_tokenizer(CountingTokenizer(byte_level)) is None


def test_a_tokenizer_that_overrides_decode_keeps_its_own(byte_level):
    class Shouting(type(byte_level)):
        def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs).upper()

    shouting = Shouting(tokenizer_object=byte_level.backend_tokenizer, eos_token=EOS)
    assert raw_tokenizer(shouting) is None
    detok, deltas = stream(shouting, byte_level.encode("naïve café"), [])
    assert "".join(deltas) == "NAÏVE CAFÉ"
