"""Our models against Hugging Face ``transformers`` on the same random-weight checkpoints.

The paged runs go through chunked prefill, decode rows batched with prefill chunks, random non-contiguous
blocks, prompts ending mid-block and on a block edge, and prompts longer than the sliding windows; every row's
logits must equal HF's full-sequence logits at that position.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ksana.kernels.cpu.packed import dense_weight
from ksana.models import ModelShape, load_model
from ksana.models.shape import sliding_windows_from_hf_config
from ksana.worker.kv_cache import KVCache
from tests.model_factory import (
    EOS_TOKEN_ID,
    FAMILIES,
    FORMATS,
    BlockPool,
    PagedSequence,
    build_step,
    hf_logits,
    load_hf_model,
    make_checkpoint,
    make_hf_model,
    random_prompts,
    save_checkpoint,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# A: 1 token; B: mid-block; C, D: exactly one / two blocks; E: mid-block, past all windows;
# F: 300 tokens in three chunks; G: joins at step 2.
PROMPT_LENS = {"A": 1, "B": 7, "C": 16, "D": 32, "E": 45, "F": 300, "G": 23}
# Each step: (sequence, new tokens); decode rows first, as the runner orders them.
PLAN = [
    [("A", 1), ("B", 7), ("C", 16), ("D", 32), ("E", 45), ("F", 100)],
    [("A", 1), ("B", 1), ("C", 1), ("D", 1), ("E", 1), ("F", 150), ("G", 23)],
    [("A", 1), ("B", 1), ("C", 1), ("D", 1), ("E", 1), ("G", 1), ("F", 50)],
    [("A", 1), ("B", 1), ("C", 1), ("D", 1), ("E", 1), ("G", 1), ("F", 1)],
    [("A", 1), ("B", 1), ("C", 1), ("D", 1), ("E", 1), ("G", 1), ("F", 1)],
]


def plan_tokens() -> dict[str, list[int]]:
    """Each sequence's tokens: its prompt plus the tokens it is fed in later steps (teacher forcing)."""
    total = dict.fromkeys(PROMPT_LENS, 0)
    for step in PLAN:
        for name, n in step:
            total[name] += n
    return dict(zip(PROMPT_LENS, random_prompts([total[n] for n in PROMPT_LENS], seed=7), strict=True))


def run_paged(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Run PLAN through ``model``; per sequence, the logits ``[num_tokens, vocab]`` we produced."""
    seqs = {name: PagedSequence(tokens) for name, tokens in plan_tokens().items()}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in PROMPT_LENS}
    cache = KVCache.allocate(model.shape, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
    pool = BlockPool(NUM_BLOCKS, seed=3)
    with torch.inference_mode():
        for step in PLAN:
            input_ids, positions, meta = build_step([(seqs[n], k) for n, k in step], BLOCK_SIZE, pool)
            step_logits = model.compute_logits(model(input_ids, positions, cache.layers, meta))
            assert step_logits.dtype == torch.float32
            assert step_logits.shape == (len(input_ids), model.shape.vocab_size)
            start = 0
            for name, k in step:
                logits[name].append(step_logits[start : start + k])
                start += k
    blocks = [b for s in seqs.values() for b in s.block_ids]
    assert len(blocks) == len(set(blocks))
    assert all(s.num_computed_tokens == len(s.token_ids) for s in seqs.values())
    return {name: torch.cat(parts) for name, parts in logits.items()}


def hf_reference(hf_model) -> dict[str, torch.Tensor]:
    return {name: hf_logits(hf_model, tokens) for name, tokens in plan_tokens().items()}


def assert_close_to(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    for name, logits in ours.items():
        torch.testing.assert_close(logits, reference[name], rtol=1e-4, atol=1e-4, msg=f"sequence {name}")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory):
    """Per family: the HF model (written in every format by the tests) and its reference logits, made once."""
    cache = {}

    def get(family: str):
        if family not in cache:
            hf = make_hf_model(family)
            cache[family] = hf, hf_reference(hf)
        return cache[family]

    return get


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_logits_match_hf(tmp_path: Path, family_models, family: str, fmt: str) -> None:
    hf, reference = family_models(family)
    model_dir = save_checkpoint(hf, tmp_path / "ckpt", fmt)
    assert_close_to(run_paged(load_model(model_dir)), reference)


def assert_matches_hf(model_dir: Path, ours: dict[str, torch.Tensor]) -> None:
    assert_close_to(ours, hf_reference(load_hf_model(model_dir)))


def test_sliding_window_changes_logits(tmp_path: Path) -> None:
    """The SWA checkpoints really depend on their windows, so the parity above checks the window masks."""
    prompt = random_prompts([120], seed=1)[0]
    windowed = hf_logits(make_hf_model("qwen2-mixed-swa"), prompt)
    full = hf_logits(make_hf_model("qwen2-mixed-swa", layer_types=["full_attention"] * 3), prompt)
    torch.testing.assert_close(windowed[:16], full[:16], rtol=1e-4, atol=1e-4)
    assert (windowed[20:] - full[20:]).abs().max() > 0.1


def test_prompts_give_different_greedy_tokens(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path, "llama")
    ours = run_paged(load_model(model_dir))
    greedy = {name: tuple(logits.argmax(-1).tolist()) for name, logits in ours.items()}
    assert len(set(greedy.values())) == len(greedy)
    assert len({t for g in greedy.values() for t in g}) > 20


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"attention_bias": True, "mlp_bias": True},
    ],
    ids=["tied", "llama3-rope", "biases"],
)
def test_llama_variants_match_hf(tmp_path: Path, overrides: dict) -> None:
    model_dir = make_checkpoint(tmp_path, "llama", **overrides)
    model = load_model(model_dir)
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head_weight is model.embed_weight
    assert_matches_hf(model_dir, run_paged(model))


def test_legacy_rope_theta_and_scaling_keys(tmp_path: Path) -> None:
    """A transformers-4 style config.json (top-level ``rope_theta``, ``rope_scaling``) loads the same rope."""
    model_dir = make_checkpoint(tmp_path, "qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config |= {"rope_theta": 777.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert_matches_hf(model_dir, run_paged(load_model(model_dir)))


def test_missing_lm_head_ties_embeddings(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path, "qwen2")
    state = load_file(model_dir / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, model_dir / "model.safetensors")
    model = load_model(model_dir)
    assert model.lm_head_weight is model.embed_weight
    table = dense_weight(model.embed_weight)  # packed for the native matmul on AVX-512 CPUs
    torch.testing.assert_close(model.compute_logits(table[:3]), table[:3] @ table.T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_hf(tmp_path: Path, dtype: torch.dtype) -> None:
    model_dir = make_checkpoint(tmp_path, "qwen2-mixed-swa")
    model = load_model(model_dir, dtype=dtype)
    assert model.embed_weight.dtype == dtype
    ours = run_paged(model, dtype)
    hf = load_hf_model(model_dir, dtype)
    agree = total = 0
    for name, ref in hf_reference(hf).items():
        logits = ours[name]
        assert (logits - ref).abs().max() < 0.5
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
    assert agree >= 0.9 * total


def test_model_shape_from_config(tmp_path: Path) -> None:
    shapes = {
        f: load_model(make_checkpoint(tmp_path, f)).shape for f in ("llama", "qwen2-mixed-swa", "mistral")
    }
    assert shapes["llama"] == ModelShape(
        model_type="llama",
        num_layers=3,
        hidden_size=96,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=1024,
        sliding_windows=[None] * 3,
        eos_token_ids=[EOS_TOKEN_ID],
        dtype=torch.float32,
    )
    assert shapes["qwen2-mixed-swa"].sliding_windows == [16, None, 16]
    assert shapes["mistral"].sliding_windows == [20, 20, 20]
    assert shapes["mistral"].num_kv_heads == 1


def test_legacy_qwen2_windows_without_layer_types() -> None:
    from types import SimpleNamespace

    def qwen2(**kw):
        return SimpleNamespace(model_type="qwen2", num_hidden_layers=4, layer_types=None, **kw)

    legacy = qwen2(sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert sliding_windows_from_hf_config(legacy) == [None, None, 8, 8]
    assert sliding_windows_from_hf_config(qwen2(sliding_window=8, use_sliding_window=False)) == [None] * 4
    mistral = SimpleNamespace(model_type="mistral", num_hidden_layers=2, sliding_window=None)
    assert sliding_windows_from_hf_config(mistral) == [None, None]


def test_kv_cache_allocate_and_size(tmp_path: Path) -> None:
    shape = load_model(make_checkpoint(tmp_path, "mistral")).shape
    cache = KVCache.allocate(shape, num_blocks=5, block_size=8, dtype=torch.bfloat16, device="cpu")
    assert len(cache.layers) == 3
    for k, v in cache.layers:
        assert k.shape == v.shape == (5, 8, 1, 16)
        assert k.dtype == torch.bfloat16 and k.data_ptr() != v.data_ptr()
    expected = sum(k.nbytes + v.nbytes for k, v in cache.layers) // 5
    assert KVCache.bytes_per_block(shape, 8, torch.bfloat16) == expected


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path, "llama")
    state = load_file(model_dir / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir)


def test_shape_mismatch_names_tensor_and_file(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path, "llama", fmt="bin")
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 100
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight.*pytorch_model\.bin"):
        load_model(model_dir)


def test_unsupported_model_type_and_missing_weights(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path / "gpt2")
    model_dir = make_checkpoint(tmp_path, "qwen2")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(model_dir)
