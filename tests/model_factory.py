"""Tiny random-weight Hugging Face checkpoints and paged-batch helpers, shared by the tests.

``make_checkpoint`` writes a deterministic checkpoint (same family, seed and overrides give the same weights)
in any format the loader reads. ``PagedSequence`` / ``build_step`` turn "these sequences get these many new
tokens" into the flat ``input_ids``/``positions``/``AttentionMetadata`` a forward pass takes, with blocks drawn
at random (non-contiguous) from a pool, the way the cache manager hands them out.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import attrs
import torch

from ksana.kernels.attention_metadata import AttentionMetadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("llama", "qwen2", "qwen2-mixed-swa", "mistral")
# DeepSeek-V3 (MLA, MoE): with a q_lora_rank, and with a plain q_proj (q_lora_rank None).
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v3-no-q-lora")
FORMATS = ("safetensors", "sharded-safetensors", "bin", "sharded-bin")
VOCAB_SIZE = 512
# An id the random models rarely favour, so greedy runs do not stop early unless a test wants them to.
EOS_TOKEN_ID = VOCAB_SIZE - 1

_BASE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=EOS_TOKEN_ID,
)
_FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    # Non-power-of-two head counts: 6 query heads over 2 KV heads.
    "llama": dict(model_type="llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2"),
    "qwen2-mixed-swa": dict(
        model_type="qwen2",
        use_sliding_window=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "mistral": dict(model_type="mistral", num_key_value_heads=1, sliding_window=20),
}
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    num_key_value_heads=4,
    head_dim=None,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_interleave=True,
    num_nextn_predict_layers=0,
)
_FAMILY_CONFIGS |= {
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v3-no-q-lora": {**_DEEPSEEK_V3, "q_lora_rank": None, "rope_interleave": False},
}


def tiny_config(family: str, **config_overrides: Any):
    """The ``transformers`` config of a tiny model of ``family`` (one of ``FAMILIES``)."""
    from transformers import AutoConfig

    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kwargs = {**_BASE, **_FAMILY_CONFIGS[family], **config_overrides}
    if kwargs.get("head_dim", 0) is None:
        del kwargs["head_dim"]  # DeepSeek-V3's config derives it (the rope head size)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def make_hf_model(family: str, seed: int = 0, **config_overrides: Any):
    """A random-weight ``transformers`` model in eval mode, float32."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights initialise to ones and biases to zeros; perturb them so a swapped or skipped norm or bias shows
    # in the logits (DeepSeek's expert-choice bias too: it must steer the choice and nothing else).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.02)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    return model.eval()


def make_checkpoint(
    tmp_dir: str | Path, family: str, fmt: str = "safetensors", seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a tiny checkpoint to ``tmp_dir/<family>-<fmt>-<seed>`` and return that directory.

    ``fmt``: "safetensors", "sharded-safetensors", "bin" (``pytorch_model.bin``) or "sharded-bin"
    (``pytorch_model-0000x-of-0000y.bin`` + index).
    """
    model = make_hf_model(family, seed, **config_overrides)
    return save_checkpoint(model, Path(tmp_dir) / f"{family}-{fmt}-{seed}", fmt)


def save_checkpoint(model, out: str | Path, fmt: str = "safetensors") -> Path:
    """Write ``model`` (a ``transformers`` model) to ``out`` in checkpoint format ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        model.save_pretrained(out)
    elif fmt == "sharded-safetensors":
        model.save_pretrained(out, max_shard_size="100KB")
        assert (out / "model.safetensors.index.json").is_file()
    else:
        model.config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        state = {name: t.contiguous() for name, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if fmt == "bin":
            torch.save(state, out / "pytorch_model.bin")
        else:
            _save_sharded_bin(state, out, num_shards=3)
    return out


def _save_sharded_bin(state: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    names = list(state)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"pytorch_model-{shard + 1:05d}-of-{num_shards:05d}.bin"
        part = {n: state[n] for n in names[shard::num_shards]}
        torch.save(part, out / file_name)
        weight_map |= dict.fromkeys(part, file_name)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence float32 logits ``[len, vocab]`` of one sequence."""
    ids = torch.tensor([token_ids], dtype=torch.long)
    return hf_model(input_ids=ids, use_cache=False).logits[0].float()


@torch.inference_mode()
def hf_greedy_generate(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation, ignoring EOS (recomputes the full sequence each step: slow but unambiguous)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(hf_logits(hf_model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def random_prompts(lengths: list[int], vocab_size: int = VOCAB_SIZE, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size - 1) for _ in range(n)] for n in lengths]


@attrs.define
class BlockPool:
    """Hands out block ids in a shuffled order, so sequences get non-contiguous, interleaved blocks."""

    num_blocks: int
    seed: int = 0
    free: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


@attrs.define
class PagedSequence:
    """A sequence's tokens, its blocks and how many of its tokens are already in the KV cache."""

    token_ids: list[int]
    block_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0


def build_step(
    plan: list[tuple[PagedSequence, int]],
    block_size: int,
    pool: BlockPool,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat ``input_ids``, ``positions`` and metadata for computing ``n`` new tokens of each planned sequence.

    Decode rows (one new token) must come first in ``plan``; blocks are taken from ``pool`` as needed.
    Advances each sequence's ``num_computed_tokens``.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for seq, num_new in plan:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        assert end <= len(seq.token_ids), "plan asks for tokens the sequence does not have"
        while len(seq.block_ids) * block_size < end:
            seq.block_ids.append(pool.take())
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [seq.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_lens.append(num_new)
        seq_lens.append(end)
        seq.num_computed_tokens = end
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    assert all(n != 1 for n in query_lens[num_decodes:]), "decode rows must come first"
    max_blocks = max(len(seq.block_ids) for seq, _ in plan)
    tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq, _ in plan]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_mapping=as_tensor(slots),
        query_start_loc=as_tensor(query_start_loc),
        seq_lens=as_tensor(seq_lens),
        block_tables=as_tensor(tables),
        block_size=block_size,
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    return as_tensor(input_ids), as_tensor(positions), meta
