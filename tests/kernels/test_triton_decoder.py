"""The Triton op set drives a real decoder: its logits equal the torch op set's through prefill and decode.

Catches what per-kernel tests cannot: how the decoder calls the ops (strided q/k/v views of the fused qkv
output, cos/sin in the model dtype, decode rows batched with prefill chunks, sliding-window and full layers in
one model). A tiny two-layer Qwen2, one sliding-window layer (window 16) and one full, runs under the
interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

from ksana.kernels.backends import triton_ops
from ksana.kernels.cpu.packed import PackedWeight
from ksana.kernels.dispatch import TORCH_OPS, KernelOps
from ksana.models import load_model
from ksana.worker.kv_cache import KVCache
from tests.model_factory import BlockPool, PagedSequence, build_step, make_checkpoint, random_prompts

BLOCK_SIZE = 16
NUM_BLOCKS = 24
# Decode rows first; B ends mid-block, C on a block edge; E is prefilled in two chunks, the second over a
# cached prefix longer than the window; G arrives in step 2.
PLAN = [
    [("A", 1), ("B", 7), ("C", 16), ("E", 40)],
    [("A", 1), ("B", 1), ("C", 1), ("E", 5), ("G", 20)],
]


def use_ops(model: torch.nn.Module, ops: KernelOps) -> None:
    """Point every module of ``model`` that holds ops at ``ops``, with the weights in the checkpoint's layout
    (what ``get_ops`` and the loader decide at build time: on an AVX-512 CPU the loader packed them for the native
    matmul, which neither of these op sets reads)."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
        for name, value in list(vars(module).items()):
            if isinstance(value, PackedWeight):
                setattr(module, name, value.dense())


def run(model, device: torch.device) -> list[torch.Tensor]:
    totals = dict.fromkeys("ABCEG", 0)
    for step in PLAN:
        for name, n in step:
            totals[name] += n
    tokens = random_prompts(list(totals.values()), seed=5)
    seqs = {name: PagedSequence(t) for name, t in zip(totals, tokens, strict=True)}
    cache = KVCache.allocate(model.shape, NUM_BLOCKS, BLOCK_SIZE, torch.float32, device)
    pool = BlockPool(NUM_BLOCKS, seed=3)
    out = []
    with torch.inference_mode():
        for step in PLAN:
            input_ids, positions, meta = build_step([(seqs[n], k) for n, k in step], BLOCK_SIZE, pool, device)
            out.append(model.compute_logits(model(input_ids, positions, cache.layers, meta)))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    return make_checkpoint(tmp_path_factory.mktemp("triton-decoder"), "qwen2-mixed-swa", **layers)


def test_triton_ops_give_the_torch_ops_logits(model_dir, triton_device):
    model = load_model(model_dir, device=triton_device)
    assert model.shape.sliding_windows[0] == 16 and model.shape.sliding_windows[1] is None
    use_ops(model, TORCH_OPS)
    expected = run(model, triton_device)
    use_ops(model, triton_ops())
    got = run(model, triton_device)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
