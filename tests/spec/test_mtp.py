"""MTP speculative decoding through the whole engine, on tiny DeepSeek-V3 checkpoints with an MTP module appended.

Lossless: greedy output with ``mtp_step_num`` 1 and 2 (one module, reused) equals the output without it, with
chunked prefill, preemption, parallel samples and the prefix cache; seeded sampling gives the same tokens. Real
acceptance: a module built to predict what the main model will say (both reduced to "the next token is a function
of this one") has nearly all of its drafts accepted.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ksana import LLM, SamplingParams
from ksana.config import ConfigError
from tests.model_factory import make_checkpoint, make_hf_model, random_prompts, save_checkpoint
from tests.models.test_deepseek_v3 import _mtp_block, _mtp_tensors, mtp_reference

PROMPTS = random_prompts([5, 17, 40, 64, 100, 9], seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)


def _append_mtp(model_dir, tensors: dict[str, torch.Tensor], num_layers: int) -> None:
    state = load_file(model_dir / "model.safetensors")
    state |= {f"model.layers.{num_layers}.{name}": t.contiguous() for name, t in tensors.items()}
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def random_mtp_parts(tmp_path_factory):
    """A DeepSeek-V3 checkpoint and a random MTP module: its drafts are mostly wrong, which exercises rejection.
    (dir, the transformers model, the module's block and tensors)."""
    hf = make_hf_model("deepseek_v3", num_nextn_predict_layers=1)
    model_dir = save_checkpoint(hf, tmp_path_factory.mktemp("mtp-random") / "ckpt")
    block = _mtp_block(hf.config, seed=5)
    tensors = _mtp_tensors(hf.config, block, seed=6)
    _append_mtp(model_dir, tensors, hf.config.num_hidden_layers)
    return model_dir, hf, block, tensors


@pytest.fixture(scope="module")
def random_mtp(random_mtp_parts):
    return random_mtp_parts[0]


_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def _agreeing_parts(tmp_dir, keep_attention: bool):
    """Every main layer's output projections zeroed: the main model's next token depends on the current token
    only (its final norm and head applied to the token's embedding). The MTP module does the same (``eh_proj``
    keeps the embedding half, its head is the main one), so it predicts the main model's next token; with
    ``keep_attention`` its block's attention still adds to that, so what it predicts depends on its KV cache and
    agrees only in part. (dir, the transformers model, the module's block and tensors)."""
    hf = make_hf_model("deepseek_v3", num_nextn_predict_layers=1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(_OUTPUT_PROJECTIONS):
                param.zero_()
    model_dir = save_checkpoint(hf, tmp_dir / "ckpt")
    block = _mtp_block(hf.config, seed=5)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if name.endswith(_OUTPUT_PROJECTIONS) and not (keep_attention and name.endswith("o_proj.weight")):
                param.zero_()
    tensors = _mtp_tensors(hf.config, block, seed=6)
    hidden = hf.config.hidden_size
    state = hf.state_dict()
    tensors |= {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                "eh_proj.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1),
                "shared_head.norm.weight": state["model.norm.weight"], "shared_head.head.weight": state["lm_head.weight"],
                "embed_tokens.weight": state["model.embed_tokens.weight"]}
    _append_mtp(model_dir, tensors, hf.config.num_hidden_layers)
    return model_dir, hf, block, tensors


@pytest.fixture(scope="module")
def agreeing_mtp(tmp_path_factory):
    return _agreeing_parts(tmp_path_factory.mktemp("mtp-agree"), keep_attention=False)[0]


@pytest.fixture(scope="module")
def attending_mtp_parts(tmp_path_factory):
    return _agreeing_parts(tmp_path_factory.mktemp("mtp-attend"), keep_attention=True)


def _run(path, prompts, params=GREEDY, **overrides):
    llm = LLM(model=str(path), dtype="float32", block_token_num=16, spec_max_batch_size=0, **overrides)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.num_blocks
    return llm, [[c.token_ids for c in r.outputs] for r in results]


@pytest.mark.parametrize("overrides", [
    {}, {"split_fuse_token_num": 24, "max_step_tokens": 64}, {"num_device_blocks": 12},
    {"enable_auto_prefix_cache": True},
], ids=["plain", "chunked-prefill", "preemption", "prefix-cache"])
@pytest.mark.parametrize("steps", [1, 2])
def test_greedy_with_mtp_equals_greedy_without(random_mtp, overrides, steps):
    prompts = PROMPTS + PROMPTS[:2]  # repeated prompts hit the prefix cache
    _, expected = _run(random_mtp, prompts, **overrides)
    llm, results = _run(random_mtp, prompts, mtp_step_num=steps, **overrides)
    assert results == expected
    stats = llm.spec_decoding_stats
    assert stats.spec_draft_token_num > 0 and len(stats.acceptance_by_position) == steps
    if "num_device_blocks" in overrides:
        assert llm.engine.scheduler.stats.num_preemptions > 0


def test_mtp_drafts_are_the_modules_own_predictions(attending_mtp_parts):
    """One draft per step: which drafts the engine verifies and accepts follows from the module's full-sequence
    predictions (``mtp_reference``) on the final tokens: the draft after a step is the module's greedy token at
    the step's last position. Equal counts mean the module's paged cache held the right K/V at every position."""
    model_dir, hf, block, tensors = attending_mtp_parts
    num_new = 24
    llm, results = _run(model_dir, PROMPTS, mtp_step_num=1)
    expected_drafts = expected_hits = 0
    for prompt, outputs in zip(PROMPTS, results, strict=True):
        tokens = prompt + outputs[0]
        predicted = mtp_reference(hf, block, tensors, tokens)[2].argmax(-1).tolist()  # row p - 1: position p + 1
        last, num_out = len(prompt), 1  # the position of the newest token, and the tokens so far
        while num_out < num_new:
            if num_new - num_out >= 2:  # a draft fits in max_tokens
                expected_drafts += 1
                accepted = predicted[last - 1] == tokens[last + 1]
                expected_hits += accepted
                last, num_out = last + 1 + accepted, num_out + 1 + accepted
            else:
                last, num_out = last + 1, num_out + 1
    stats = llm.spec_decoding_stats
    assert (stats.spec_draft_token_num, stats.spec_draft_hit_num) == (expected_drafts, expected_hits)
    assert 0 < expected_hits < expected_drafts


def test_seeded_sampling_and_parallel_samples_with_mtp(random_mtp):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, n=2, seed=7)
    _, expected = _run(random_mtp, PROMPTS, params)
    _, results = _run(random_mtp, PROMPTS, params, mtp_step_num=2)
    assert results == expected


@pytest.mark.parametrize("steps", [1, 3])
def test_an_agreeing_mtp_module_has_nearly_all_drafts_accepted(agreeing_mtp, steps):
    _, expected = _run(agreeing_mtp, PROMPTS)
    llm, results = _run(agreeing_mtp, PROMPTS, mtp_step_num=steps)
    assert results == expected
    stats = llm.spec_decoding_stats
    assert stats.acceptance_rate > 0.9, stats
    assert stats.mean_accepted_length > 1 + 0.9 * steps, stats


def test_mtp_needs_a_model_with_mtp_modules(tmp_path):
    with pytest.raises(ConfigError, match="mtp_step_num"):
        LLM(model=str(make_checkpoint(tmp_path, "llama")), mtp_step_num=1)
