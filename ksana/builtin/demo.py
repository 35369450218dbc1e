"""The ``demo`` built-in model: a tiny random-weight model with a real tokenizer, built locally in a couple of seconds.

Tests and examples need a model directory that loads like any Hugging Face checkpoint (config.json, safetensors,
tokenizer.json, a ChatML chat template) without a model hub. The tokenizer is a byte-level BPE trained on the
small corpus below, so any text round-trips; the weights come from a fixed seed, so every build is identical and
greedy outputs can be compared token for token against ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ksana.builtin.cache_dir import build_cached, transformers_progress

FAMILIES = ("qwen2", "llama")
DEMO_VERSION = 1  # bump when the built files change, so stale cached copies are not reused

VOCAB_SIZE = 1024
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
# Qwen2's split: letters with an optional leading symbol, single digits, punctuation runs, newlines, spaces.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_HIDDEN_LAYERS = 2
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
MAX_POSITION_EMBEDDINGS = 2048
WEIGHT_SEED = 1234
# Wide enough that greedy decoding wanders over the vocabulary; at 0.05 it repeats one token.
INITIALIZER_RANGE = 0.2

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a story, one token at a time.
Once upon a time there was a little town by the sea. Every morning the fishermen went out in their boats,
and every evening they came back with baskets full of fish. The children ran along the beach and built
castles of sand, while their parents talked about the weather, the prices at the market and the news.
What is the capital of France? The capital of France is Paris. What is the capital of Germany? It is Berlin.
Rome is the capital of Italy, Madrid is the capital of Spain, and London is the capital of the United Kingdom.
The sun rises in the east and sets in the west. Water boils at one hundred degrees and freezes at zero.
There are seven days in a week, twelve months in a year and twenty four hours in a day.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
January, February, March, April, May, June, July, August, September, October, November and December.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, thirty, hundred, thousand.
0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14 2.71 1,000,000 99% $5 #1 @home (a) [b] {c} <d>
You are a helpful assistant. Please answer the question clearly and briefly. Thank you very much!
Sure, I can help with that. Here is a short answer, followed by a longer explanation with an example.
The user asked a question, and the assistant gave an answer. The system message sets the rules.
Can you write a poem about the moon? The moon is bright, the night is long, the stars are singing their quiet song.
How do I make a cup of tea? Boil some water, put a tea bag in a cup, pour the water and wait for three minutes.
Computers run programs. A program is a list of instructions written in a language such as Python or C.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

import torch
x = torch.zeros(4, 8)
if x.sum() == 0:
    print("all zeros")
Language models read text as tokens. Each token is a number, and the model predicts the next number.
A cache keeps the keys and values of earlier tokens, so the model does not compute them again.
The scheduler decides which requests run in each step, and the worker runs the model on the batch.
When the memory is full, the newest request is preempted and its work is computed again later.
Good morning! How are you today? I am fine, thanks. The weather is nice, so we are going for a walk in the park.
My favourite colours are red, green, blue, yellow, orange, purple, black and white. What is yours?
Cats and dogs are popular pets. Birds sing in the trees, fish swim in the river and horses run in the fields.
The library opens at nine in the morning and closes at six in the evening, except on Sundays.
She walked into the kitchen, opened the window and started to cook dinner for her family and friends.
He read the letter twice, smiled, and put it back in the envelope before anyone could see it.
They travelled by train across the mountains, through long tunnels and over high bridges.
We learned that practice makes perfect, that patience is a virtue, and that honesty is the best policy.
Science asks questions about the world: why is the sky blue, how do plants grow, what are stars made of?
The sky is blue because air scatters blue light more than red light. Plants grow by using light from the sun.
History tells us about kings and queens, wars and peace, inventions and discoveries, cities and empires.
Music, painting, dance and theatre are arts that people have enjoyed for thousands of years.
The doctor said that sleep, exercise and good food are important for a long and healthy life.
Mathematics studies numbers, shapes and patterns. Two plus two is four, and three times three is nine.
Explain the difference between a list and a tuple. A list can change, but a tuple cannot change.
Translate "hello world" into French: "bonjour le monde". Into Spanish: "hola mundo". Into German: "hallo Welt".
Summarize the text in one sentence. Give three reasons. List the steps. Answer with yes or no.
"""


def train_tokenizer():
    """Train the byte-level BPE on CORPUS and wrap it for ``transformers``.

    The normalizer and pre-tokenizer are exactly Qwen2's: ``AutoTokenizer`` (transformers 5) rebuilds any
    ``qwen2`` model's tokenizer as ``Qwen2Tokenizer`` from vocab and merges, so a different split would silently
    change the token ids between ``tokenizers`` and ``transformers``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"demo tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )


def demo_config(family: str, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """The model config; Qwen2 keeps a separate lm_head, Llama ties it to the embeddings (like SmolLM2)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=1_000_000.0, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10_000.0, tie_word_embeddings=True)
    raise ValueError(f"unknown demo model family {family!r}; expected one of {', '.join(FAMILIES)}")


def write_demo_model(out_dir: str | Path, family: str = "qwen2") -> Path:
    """Write the demo model (``family`` "qwen2" or "llama") into ``out_dir`` and return it; same bytes every time."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown demo model family {family!r}; expected one of {', '.join(FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = demo_config(family, len(tokenizer), eos_token_id, pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, do_sample=False
    )
    with transformers_progress(False):  # a one-shard save of a 0.8 MB file needs no progress bar
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    (out_dir / "ksana_builtin.json").write_text(
        json.dumps({"name": "demo", "family": family, "version": DEMO_VERSION})
    )
    return out_dir


def _randomize(model) -> None:
    """Fill every weight from one seeded generator, in name order, so builds match across runs and versions.

    Norm weights get 1 plus a little noise and everything else N(0, INITIALIZER_RANGE); ``transformers``' own
    initialisation is not used because it draws from the global RNG in an order that may change between releases.
    """
    import torch

    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(INITIALIZER_RANGE * noise)


def demo_model_dir(family: str = "qwen2") -> Path:
    """The cached demo model directory (built on first use under the Ksana cache root)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown demo model family {family!r}; expected one of {', '.join(FAMILIES)}")
    return build_cached(f"demo-{family}-v{DEMO_VERSION}", lambda tmp_dir: write_demo_model(tmp_dir, family))
