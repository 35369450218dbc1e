"""DeepSeek-V3 (MLA, MoE) under tensor parallelism on CPU over gloo: TP=2 generates exactly what transformers and
TP=1 do, with chunked prefill and preemption (decode rows take the absorbed MLA path, prefill chunks the expanded
one, on each rank's heads); each rank caches the whole latent and holds half of every split weight; a shape whose
heads or expert size do not divide is refused naming the config key and the dimension."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ksana import LLM, SamplingParams
from ksana.config import ConfigError
from ksana.models import load_model
from ksana.models.parallel import check_tp_size
from ksana.models.shape import ModelShape
from ksana.worker.kv_cache import KVCache
from tests.model_factory import (
    DEEPSEEK_FAMILIES,
    BlockPool,
    PagedSequence,
    build_step,
    hf_greedy_generate,
    load_hf_model,
    make_checkpoint,
    random_prompts,
    tiny_config,
)
from tests.models.test_model_parity import BLOCK_SIZE, NUM_BLOCKS, PLAN, plan_tokens
from tests.tp.deepseek_rank import run_steps

RANK_SCRIPT = Path(__file__).with_name("deepseek_rank.py")

# 4-token blocks, 8-token chunks, a 24-token step budget and a small pool: chunked prefill and preemption.
ENGINE = dict(num_device_blocks=14, block_token_num=4, split_fuse_token_num=8, max_step_tokens=24, device="cpu",
              dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LENGTHS = [5, 17, 40, 9, 23]
# Parameters every rank holds whole: the latent projections and norms, the layer norms, the router.
REPLICATED = ("in_weight", "in_bias", "norm_weight", "gate_weight", "score_bias")


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-tp")
    return {family: make_checkpoint(root, family) for family in DEEPSEEK_FAMILIES}


@pytest.mark.parametrize("family", DEEPSEEK_FAMILIES)
def test_tp2_greedy_equals_transformers_and_tp1(checkpoints, tp_llm, family):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    hf = load_hf_model(checkpoints[family])
    expected = [hf_greedy_generate(hf, prompt, GREEDY.max_tokens) for prompt in prompts]
    reference = LLM(model=str(checkpoints[family]), **ENGINE)
    assert _tokens(reference, prompts) == expected
    assert reference.engine.scheduler.stats.num_preemptions > 0

    llm = tp_llm(checkpoints[family], **ENGINE)
    assert llm.engine.tp_runner.world_size == 2
    assert _tokens(llm, prompts) == expected
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.num_steps > GREEDY.max_tokens + sum(PROMPT_LENGTHS) // ENGINE["max_step_tokens"]

    # Prompt logprobs: the logits of every prompt position, gathered across the ranks' vocabulary shards.
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for want, got in zip(reference.generate(prompts, asked, use_tqdm=False),
                         llm.generate(prompts, asked, use_tqdm=False), strict=True):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(want.prompt_token_ids)
        for got_entry, want_entry in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert list(got_entry) == list(want_entry)
            assert [v.logprob for v in got_entry.values()] == pytest.approx(
                [v.logprob for v in want_entry.values()], abs=1e-4)

    # Each rank holds half of every split weight (heads, experts, vocabulary); the rest whole.
    full = replicated = 0
    for name, param in reference.engine.model.named_parameters():
        size = param.numel() * param.element_size()
        full += size
        replicated += size if name.endswith(REPLICATED) else 0
    assert llm.engine.tp_runner.rank_param_bytes() == [(full - replicated) // 2 + replicated] * 2


def test_each_rank_caches_the_whole_latent(checkpoints, tp_llm):
    """The rank's shape halves the heads and MLP sizes but keeps the one latent head: its KV cache is the full
    one, ``[blocks, block_size, 1, kv_lora_rank]`` and ``[blocks, block_size, 1, qk_rope_head_dim]`` per layer."""
    llm = tp_llm(checkpoints["deepseek_v3"], **ENGINE)
    model = llm.engine.model
    shape, rank = model.shape, model.rank_shape
    assert (rank.num_heads, rank.moe_intermediate_size, rank.intermediate_size) == (2, 16, 64)
    assert (rank.kv_cache_heads, rank.k_cache_dim, rank.v_cache_dim) == (1, 32, 8)
    assert KVCache.bytes_per_block(rank, 4, torch.float32) == KVCache.bytes_per_block(shape, 4, torch.float32)
    # On the CPU the ranks' caches share one memory: the pool is sized by both ranks' full latents.
    assert llm.engine.layout.bytes_per_block == 2 * KVCache.bytes_per_block(shape, 4, torch.float32)
    cache = llm.engine.kv_cache
    assert len(cache.layers) == shape.num_layers
    for latent, rope in cache.layers:
        assert latent.shape == (14, 4, 1, 32) and rope.shape == (14, 4, 1, 8)
    attn = model.layers[1].self_attn
    assert attn.num_heads == 2 and attn.q_weight.shape == (2 * 24, 32) and attn.kv_b_weight.shape == (2 * 32, 32)
    moe = model.layers[1].mlp
    assert moe.experts_gate_up.shape == (8 * 2 * 16, 64) and moe.shared.down_weight.shape == (64, 16)
    assert model.embed_weight.shape == (256, 64)


def test_shapes_that_do_not_divide_are_refused_naming_the_dimension():
    def shape(**overrides) -> ModelShape:
        return ModelShape.from_hf_config(tiny_config("deepseek_v3", **overrides), dtype=torch.float32)

    with pytest.raises(ConfigError, match=r"tensor_para_size' = 2 .*3 attention heads do not divide into 2 ranks "
                                          r"\(num_attention_heads\)"):
        check_tp_size(shape(num_attention_heads=3, num_key_value_heads=3), 2)
    with pytest.raises(ConfigError, match=r"expert MLP size 33 does not divide into 2 ranks \(moe_intermediate_size\)"):
        check_tp_size(shape(moe_intermediate_size=33), 2)
    with pytest.raises(ConfigError, match=r"MLP size 130 does not divide into 4 ranks \(intermediate_size\)"):
        check_tp_size(shape(intermediate_size=130), 4)
    check_tp_size(shape(intermediate_size=130, first_k_dense_replace=0), 4)  # no dense layer: nothing to split
    check_tp_size(shape(), 4)  # one latent head: no KV heads to divide
    with pytest.raises(ConfigError, match=r"4 attention heads do not divide into 8 ranks"):
        check_tp_size(shape(), 8)


def test_engine_refuses_heads_that_do_not_divide_before_spawning(tmp_path):
    model_dir = make_checkpoint(tmp_path, "deepseek_v3", num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"3 attention heads do not divide into 2 ranks \(num_attention_heads\)"):
        LLM(model=str(model_dir), tensor_para_size=2, device="cpu")


# ---- model level: the main layers and the MTP module on every rank ---------------------------------------------

def _with_mtp_module(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s checkpoint plus one MTP module (``model.layers.3``): the last layer's block under the
    module's prefix, with random norms, ``eh_proj``, embedding and shared head of its own."""
    state = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    hidden, vocab = state["model.norm.weight"].shape[0], state["lm_head.weight"].shape[0]
    state |= {name.replace("model.layers.2.", "model.layers.3."): t.clone()
              for name, t in state.items() if name.startswith("model.layers.2.")}
    for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("shared_head.norm.weight", (hidden,)), ("shared_head.head.weight", (vocab, hidden)),
                        ("embed_tokens.weight", (vocab, hidden))):
        base = 1.0 if name.endswith("norm.weight") else 0.0
        state[f"model.layers.3.{name}"] = base + torch.randn(shape, generator=generator) * 0.15
    config = json.loads((model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _run_ranks(model_dir: Path, steps_path: Path, tmp_path: Path, world_size: int = 2) -> list[list[dict]]:
    """Every rank of a TP group in a process of its own (real ranks over gloo); their ``run_steps`` results."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    outs = [tmp_path / f"rank{rank}.pt" for rank in range(world_size)]
    procs = [subprocess.Popen([sys.executable, "-P", str(RANK_SCRIPT), str(store.port), str(rank), str(world_size),
                               str(model_dir), str(steps_path), str(out)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, out in enumerate(outs)]
    try:
        logs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log}"
    return [torch.load(out, weights_only=False) for out in outs]


@pytest.mark.parametrize("variant", [*DEEPSEEK_FAMILIES, "deepseek_v3-attention-bias"])
def test_tp2_main_and_mtp_forward_equal_tp1(checkpoints, tmp_path, variant):
    """PLAN's chunked prefill and decode (absorbed and expanded MLA on each rank's heads) through the main layers
    and the MTP module: every rank's hidden states and gathered logits equal one process's. With attention biases,
    the replicated ``q_a``/``kv_a`` biases apply on every rank and the row-parallel ``o_proj`` bias once."""
    if variant in checkpoints:
        base = checkpoints[variant]
    else:
        base = make_checkpoint(tmp_path, "deepseek_v3", attention_bias=True)
        assert "model.layers.0.self_attn.o_proj.bias" in load_file(base / "model.safetensors")
    model_dir = _with_mtp_module(base, tmp_path / "mtp")
    tokens = plan_tokens()
    seqs = {name: PagedSequence(t) for name, t in tokens.items()}
    pool = BlockPool(NUM_BLOCKS, seed=4)
    torch.manual_seed(5)
    steps = []
    for step in PLAN:
        input_ids, positions, meta = build_step([(seqs[name], n) for name, n in step], BLOCK_SIZE, pool)
        steps.append((input_ids, positions, meta, torch.randn(len(input_ids), 64)))
    steps_path = tmp_path / "steps.pt"
    torch.save((steps, NUM_BLOCKS, BLOCK_SIZE), steps_path)

    model = load_model(model_dir)
    assert model.num_mtp_layers == 1
    expected = run_steps(model, steps, NUM_BLOCKS, BLOCK_SIZE)
    for rank, results in enumerate(_run_ranks(model_dir, steps_path, tmp_path)):
        for index, (got, want) in enumerate(zip(results, expected, strict=True)):
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, k=key, i=index, r=rank: f"rank {r}, step {i}, {k}: {m}")


def test_perf_run_with_tp2_times_the_all_reduce(checkpoints, tmp_path):
    """``ksana perf`` on a DeepSeek-V3 checkpoint at TP=2: two all-reduces per layer pass (after ``o_proj``, after
    the MLP or the experts' sum), plus the vocabulary-parallel embedding and the logits gather."""
    rounds, num_layers = 2, 3
    batches = {"batch_0": {"dp_0": [{"forwarding_token_num": 16, "sequence_len": 16},
                                    {"forwarding_token_num": 1, "sequence_len": 40, "request_num": 2}]}}
    (tmp_path / "batches.json").write_text(json.dumps(batches))
    (tmp_path / "runtime.yaml").write_text("setting:\n  global:\n    tensor_para_size: 2\n")
    config = {"model_dir": str(checkpoints["deepseek_v3"]), "batch_config": "batches.json",
              "runtime_config": "runtime.yaml", "warmup_rounds": 1, "stat_rounds": 1, "output_file": "result.json",
              "layer_forward_round": rounds}
    (tmp_path / "model_perf_config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "ksana.cli", "perf", "--config", str(tmp_path / "model_perf_config.json"),
         "--no-progress", "--device", "cpu"], capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["meta"]["runtime"]["tensor_para_size"] == 2
    for round_ in result["batches"][0]["rounds"]:
        ops = round_["operators"]
        assert ops["all_reduce"]["calls"] == 2 * num_layers * rounds + 2
        assert min(ops["all_reduce"]["per_layer_ms"]) > 0
        assert ops["attention_prefill"]["calls"] == num_layers * rounds


def test_mtp_drafting_under_tp2_is_lossless_and_drafts_as_tp1(tmp_path, tp_llm):
    """Every rank runs the MTP module's forward (its collectives), on rank 0's sampled tokens: the greedy output
    is the output without drafts, and the drafts are TP=1's (the same acceptance counts)."""
    from tests.spec.test_mtp import _agreeing_parts

    model_dir = _agreeing_parts(tmp_path, keep_attention=True)[0]
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    spec = dict(mtp_step_num=2, spec_max_batch_size=0)
    plain = _tokens(LLM(model=str(model_dir), **ENGINE), prompts)
    reference = LLM(model=str(model_dir), **ENGINE, **spec)
    assert _tokens(reference, prompts) == plain
    llm = tp_llm(model_dir, **ENGINE, **spec)
    assert len(llm.engine.kv_cache.layers) == llm.engine.shape.num_layers + 1
    assert _tokens(llm, prompts) == plain
    got, want = llm.spec_decoding_stats, reference.spec_decoding_stats
    assert want.spec_draft_hit_num > 0
    assert (got.spec_draft_token_num, got.spec_draft_hit_num) == (want.spec_draft_token_num, want.spec_draft_hit_num)
