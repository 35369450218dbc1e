"""DeepSeek-V3 (MLA, MoE, MTP) against ``transformers``' ``DeepseekV3ForCausalLM`` on tiny random checkpoints.

The paged runs go through test_model_parity.py's PLAN (chunked prefill, decode rows batched with prefill chunks,
random non-contiguous blocks): decode rows take the absorbed MLA path, prefill chunks the expanded one. The MTP
module is checked against a full-sequence reference made of transformers' own decoder layer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ksana.config import ConfigError
from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.models import ModelShape, load_model
from ksana.models.deepseek_v3 import DeepseekV3ForCausalLM
from ksana.models.parallel import check_tp_size
from ksana.models.registry import MODEL_FAMILIES
from ksana.worker.kv_cache import KVCache
from tests.model_factory import (
    DEEPSEEK_FAMILIES,
    BlockPool,
    PagedSequence,
    build_step,
    hf_logits,
    load_hf_model,
    make_checkpoint,
    make_hf_model,
    random_prompts,
    save_checkpoint,
    tiny_config,
)
from tests.models.test_model_parity import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PLAN,
    PROMPT_LENS,
    assert_close_to,
    assert_matches_hf,
    hf_reference,
    plan_tokens,
    run_paged,
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("fmt", ["safetensors", "sharded-safetensors"])
@pytest.mark.parametrize("family", DEEPSEEK_FAMILIES)
def test_paged_logits_match_hf(tmp_path: Path, family: str, fmt: str) -> None:
    hf = make_hf_model(family)
    model = load_model(save_checkpoint(hf, tmp_path / "ckpt", fmt))
    assert isinstance(model, DeepseekV3ForCausalLM) and model.num_mtp_layers == 0
    assert_close_to(run_paged(model), hf_reference(hf))


def test_yarn_rope_and_mscale_match_hf(tmp_path: Path) -> None:
    """YaRN past its original context (the PLAN reaches position 300 > 64), with DeepSeek's mscale on the softmax
    scale; the mscale really changes the logits, so the parity checks it."""
    model_dir = make_checkpoint(tmp_path, "deepseek_v3", rope_parameters=YARN)
    assert_matches_hf(model_dir, run_paged(load_model(model_dir)))
    prompt = random_prompts([40], seed=2)[0]
    without = make_hf_model("deepseek_v3", rope_parameters={**YARN, "mscale_all_dim": 0.0})
    assert (hf_logits(load_hf_model(model_dir), prompt) - hf_logits(without, prompt)).abs().max() > 1e-2


def test_bfloat16_close_to_hf(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path, "deepseek_v3")
    model = load_model(model_dir, dtype=torch.bfloat16)
    assert model.embed_weight.dtype == torch.bfloat16
    assert model.layers[1].mlp.gate_weight.dtype == torch.float32  # the router stays float32, as in transformers
    ours = run_paged(model, torch.bfloat16)
    agree = total = 0
    for name, ref in hf_reference(load_hf_model(model_dir, torch.bfloat16)).items():
        assert (ours[name] - ref).abs().max() < 0.5, name
        agree += int((ours[name].argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
    assert agree >= 0.9 * total


def test_router_matches_transformers() -> None:
    """Expert choice and weights equal transformers' router's, and the correction bias changes the choice (it is
    used for choosing, not weighting)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from ksana.kernels.dispatch import get_ops
    from ksana.models.moe import DeepseekMoE

    config = tiny_config("deepseek_v3")
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.3)
    ours = DeepseekMoE(config, torch.float32, get_ops("cpu"), torch.device("cpu"))
    with torch.no_grad():
        ours.gate_weight.copy_(router.weight)
        ours.score_bias.copy_(router.e_score_correction_bias)
    hidden = torch.randn(200, config.hidden_size)
    _, hf_weights, hf_ids = router(hidden)
    ids, weights = ours.route(hidden)
    hf_order, order = hf_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    with torch.no_grad():
        ours.score_bias.zero_()
    unbiased, _ = ours.route(hidden)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)


def test_kv_cache_holds_the_latent_per_token(tmp_path: Path) -> None:
    """One latent "head" per token and layer: (kv_lora_rank + qk_rope_head_dim) elements; MTP layers on request;
    the transfer payload round-trips through blocks of the two widths."""
    shape = load_model(make_checkpoint(tmp_path, "deepseek_v3")).shape
    assert (shape.kv_cache_heads, shape.k_cache_dim, shape.v_cache_dim) == (1, 32, 8)
    block_size, dtype = 8, torch.bfloat16
    assert KVCache.bytes_per_block(shape, block_size, dtype) == 3 * block_size * (32 + 8) * 2
    assert KVCache.bytes_per_block(shape, block_size, dtype, extra_layers=1) == 4 * block_size * (32 + 8) * 2
    cache = KVCache.allocate(shape, num_blocks=5, block_size=block_size, dtype=dtype, device="cpu", extra_layers=1)
    assert len(cache.layers) == 4 and cache.extra_layers == 1
    for latent, rope in cache.layers:
        assert latent.shape == (5, block_size, 1, 32) and rope.shape == (5, block_size, 1, 8)
    assert sum(k.nbytes + v.nbytes for k, v in cache.layers) // 5 == KVCache.bytes_per_block(shape, 8, dtype, 1)
    for latent, rope in cache.layers:
        latent.normal_()
        rope.normal_()
    payload = cache.gather_blocks((3, 1), num_tokens=12)
    assert payload.numel() == cache.payload_bytes(12) == 2 * 4 * block_size * (32 + 8) * 2
    other = KVCache.allocate(shape, num_blocks=5, block_size=block_size, dtype=dtype, device="cpu", extra_layers=1)
    other.scatter_blocks((0, 4), 12, payload)
    for (k, v), (k2, v2) in zip(cache.layers, other.layers, strict=True):
        assert torch.equal(k[[3, 1]], k2[[0, 4]]) and torch.equal(v[[3, 1]], v2[[0, 4]])
    assert other.write_block(2, -1, cache.block_tensors(1, -1))
    assert torch.equal(other.layers[3][1][2], cache.layers[3][1][1])


def test_other_families_keep_their_kv_layout(tmp_path: Path) -> None:
    shape = load_model(make_checkpoint(tmp_path, "mistral")).shape
    assert not shape.is_mla and shape.num_mtp_layers == 0
    cache = KVCache.allocate(shape, num_blocks=5, block_size=8, dtype=torch.float32, device="cpu")
    assert [(k.shape, v.shape) for k, v in cache.layers] == [((5, 8, 1, 16), (5, 8, 1, 16))] * 3
    assert KVCache.bytes_per_block(shape, 8, torch.float32) == 2 * 3 * 8 * 1 * 16 * 4
    assert cache.payload_bytes(9) == 2 * KVCache.bytes_per_block(shape, 8, torch.float32)


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path, "deepseek_v3")
    state = load_file(model_dir / "model.safetensors")
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(model_dir)


def test_tensor_parallel_sizes_that_divide_are_accepted() -> None:
    """4 heads, expert size 32, MLP 128: 2 and 4 ranks split them (tests/tp/test_deepseek_v3_tp.py runs them)."""
    assert MODEL_FAMILIES["deepseek_v3"] is DeepseekV3ForCausalLM
    shape = ModelShape.from_hf_config(tiny_config("deepseek_v3"), torch.float32)
    for tp_size in (1, 2, 4):
        check_tp_size(shape, tp_size)
    with pytest.raises(ConfigError, match="attention heads do not divide"):
        check_tp_size(shape, 3)


# ---- MTP ------------------------------------------------------------------------------------------------------

def _mtp_block(config, seed: int):
    """A transformers decoder layer with random weights (its MoE's are uninitialised by the constructor), in the
    role of the MTP module's block."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + torch.randn_like(param) * 0.1)
            else:
                param.normal_(0, 0.15)
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return layer


def _mtp_tensors(config, layer, seed: int) -> dict[str, torch.Tensor]:
    """The module's tensors as DeepSeek's checkpoints name them (per-expert projections), unprefixed."""
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab, size = config.hidden_size, config.vocab_size, config.moe_intermediate_size

    def rand(*shape: int, scale: float = 0.15, base: float = 0.0) -> torch.Tensor:
        return base + torch.randn(*shape, generator=generator) * scale

    tensors = {"enorm.weight": rand(hidden, scale=0.1, base=1.0), "hnorm.weight": rand(hidden, scale=0.1, base=1.0),
               "eh_proj.weight": rand(hidden, 2 * hidden), "shared_head.norm.weight": rand(hidden, scale=0.1, base=1.0),
               "shared_head.head.weight": rand(vocab, hidden), "embed_tokens.weight": rand(vocab, hidden)}
    for name, tensor in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e in range(tensor.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = tensor[e, :size]
                tensors[f"mlp.experts.{e}.up_proj.weight"] = tensor[e, size:]
        elif name == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[name] = tensor
    return {name: t.contiguous().clone() for name, t in tensors.items()}


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A saved HF DeepSeek-V3 with one MTP module appended as ``model.layers.3.*``; (dir, hf model, block, its
    tensors)."""
    hf = make_hf_model("deepseek_v3", num_nextn_predict_layers=1)
    model_dir = save_checkpoint(hf, tmp_path_factory.mktemp("mtp") / "ckpt")
    layer = _mtp_block(hf.config, seed=5)
    tensors = _mtp_tensors(hf.config, layer, seed=6)
    state = load_file(model_dir / "model.safetensors")
    prefix = f"model.layers.{hf.config.num_hidden_layers}"
    state |= {f"{prefix}.{name}": t for name, t in tensors.items()}
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir, hf, layer, tensors


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.inference_mode()
def mtp_reference(hf, layer, tensors: dict[str, torch.Tensor], tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """DeepSeek's MTP over one whole sequence: rows for positions 1..n-1, row p from token p and the main model's
    final hidden state at p - 1, through transformers' decoder layer (causal, rotary at those positions).
    Returns (the main hidden states [n, H], the module's outputs [n - 1, H], its logits [n - 1, V])."""
    eps = hf.config.rms_norm_eps
    ids = torch.tensor([tokens])
    main_hidden = hf.model(input_ids=ids).last_hidden_state[0]
    embedded = torch.nn.functional.embedding(ids[0, 1:], tensors["embed_tokens.weight"])
    joined = torch.cat((_rms(embedded, tensors["enorm.weight"], eps),
                        _rms(main_hidden[:-1], tensors["hnorm.weight"], eps)), dim=-1)
    hidden = (joined @ tensors["eh_proj.weight"].T)[None]
    positions = torch.arange(1, len(tokens))[None]
    rotary = hf.model.rotary_emb(hidden, positions)
    out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)[0]
    logits = _rms(out, tensors["shared_head.norm.weight"], eps) @ tensors["shared_head.head.weight"].T
    return main_hidden, out, logits


def test_mtp_module_loads(mtp_checkpoint, caplog) -> None:
    model_dir, *_ = mtp_checkpoint
    with caplog.at_level(logging.WARNING, logger="ksana.models.loader"):
        model = load_model(model_dir)
    assert not caplog.records
    assert model.num_mtp_layers == 1 and model.shape.num_mtp_layers == 1
    assert model.mtp_layers[0].embed_weight is not model.embed_weight  # the checkpoint's own copy


def test_mtp_forward_matches_reference(mtp_checkpoint) -> None:
    """PLAN's chunked prefill and decode through the MTP module's own cache layer (``num_layers + 0`` of a cache
    allocated with the extra layer), previous hidden states from the main model; a row at position 0 takes a
    random previous hidden state, which must not reach any other row."""
    model_dir, hf, layer, tensors = mtp_checkpoint
    model = load_model(model_dir)
    tokens = plan_tokens()
    reference = {name: mtp_reference(hf, layer, tensors, t) for name, t in tokens.items()}
    seqs = {name: PagedSequence(t) for name, t in tokens.items()}
    cache = KVCache.allocate(model.shape, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu",
                             extra_layers=model.num_mtp_layers)
    pool = BlockPool(NUM_BLOCKS, seed=4)
    hidden_out: dict[str, list[torch.Tensor]] = {name: [] for name in PROMPT_LENS}
    logits_out: dict[str, list[torch.Tensor]] = {name: [] for name in PROMPT_LENS}
    torch.manual_seed(9)
    with torch.inference_mode():
        for step in PLAN:
            plan = [(seqs[name], n) for name, n in step]
            input_ids, positions, meta = build_step(plan, BLOCK_SIZE, pool)
            previous = []
            for name, n in step:
                main_hidden = reference[name][0]
                for p in range(seqs[name].num_computed_tokens - n, seqs[name].num_computed_tokens):
                    previous.append(torch.randn(1, main_hidden.shape[1]) if p == 0 else main_hidden[p - 1 : p])
            hidden = model.mtp_forward(0, input_ids, positions, torch.cat(previous), cache.layers[3], meta)
            logits = model.mtp_compute_logits(0, hidden)
            assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), 512)
            assert torch.isfinite(hidden).all()
            start = 0
            for name, n in step:
                hidden_out[name].append(hidden[start : start + n])
                logits_out[name].append(logits[start : start + n])
                start += n
    for name, (_, ref_hidden, ref_logits) in reference.items():
        # Row 0 (position 0) has no reference: DeepSeek's MTP rows start at position 1.
        torch.testing.assert_close(torch.cat(hidden_out[name])[1:], ref_hidden, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(torch.cat(logits_out[name])[1:], ref_logits, rtol=1e-4, atol=1e-4, msg=name)


def test_mtp_decode_row_matches_prefill_row(mtp_checkpoint) -> None:
    """The absorbed decode path of the MTP layer hides position 0 as the prefill path does: a sequence prefilled
    in one chunk and the same tokens decoded one by one give the same rows."""
    model_dir, hf, layer, tensors = mtp_checkpoint
    model = load_model(model_dir)
    tokens = random_prompts([6], seed=3)[0]
    main_hidden = mtp_reference(hf, layer, tensors, tokens)[0]
    previous = torch.cat((torch.randn(1, main_hidden.shape[1]) * 5, main_hidden[:-1]))
    outs = []
    for chunks in ([6], [1] * 6):
        seq = PagedSequence(tokens)
        cache = KVCache.allocate(model.shape, 8, 4, torch.float32, "cpu", extra_layers=1)
        pool = BlockPool(8, seed=1)
        rows = []
        with torch.inference_mode():
            for n in chunks:
                start = seq.num_computed_tokens
                input_ids, positions, meta = build_step([(seq, n)], 4, pool)
                assert isinstance(meta, AttentionMetadata) and meta.num_decodes == (n == 1)
                rows.append(model.mtp_forward(0, input_ids, positions, previous[start : start + n],
                                              cache.layers[3], meta))
        outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_mtp_without_its_copies_shares_the_main_tables(mtp_checkpoint, tmp_path: Path) -> None:
    model_dir, *_ = mtp_checkpoint
    state = load_file(model_dir / "model.safetensors")
    del state["model.layers.3.embed_tokens.weight"], state["model.layers.3.shared_head.head.weight"]
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model = load_model(out)
    assert model.num_mtp_layers == 1
    assert model.mtp_layers[0].embed_weight is model.embed_weight
    assert model.mtp_layers[0].head_weight is model.lm_head_weight


def test_config_claiming_mtp_without_tensors_loads_none(tmp_path: Path, caplog) -> None:
    """transformers' DeepSeek-V3 config claims one MTP module by default; a checkpoint without its tensors loads
    with none and no warning. A module only partly there is an error naming what is missing."""
    model_dir = make_checkpoint(tmp_path, "deepseek_v3")
    config = json.loads((model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="ksana.models.loader"):
        model = load_model(model_dir)
    assert not caplog.records
    assert model.num_mtp_layers == 0 and model.shape.num_mtp_layers == 0
    state = load_file(model_dir / "model.safetensors")
    state["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.3\."):
        load_model(model_dir)
