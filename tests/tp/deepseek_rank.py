"""One rank of a DeepSeek-V3 tensor-parallel group, for test_deepseek_v3_tp.py's model-level checks (the MTP module
runs outside the engine's steps, so every rank calls it here).

``python -P tests/tp/deepseek_rank.py PORT RANK WORLD_SIZE MODEL_DIR STEPS OUT``: joins the group whose store
listens on 127.0.0.1:PORT, loads this rank's shard of MODEL_DIR, runs ``run_steps`` over the steps saved in STEPS
and saves what it returns to OUT.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from ksana.models import load_model
from ksana.models.parallel import TPGroup
from ksana.worker.kv_cache import KVCache

TIMEOUT_S = 120.0


@torch.inference_mode()
def run_steps(model, steps: list[tuple], num_blocks: int, block_size: int) -> list[dict[str, torch.Tensor]]:
    """Per step ``(input_ids, positions, meta, previous_hidden)``: the main model's hidden states and logits, then
    MTP module 0's over the same rows, through a cache of ``model.rank_shape`` with the MTP layer."""
    cache = KVCache.allocate(model.rank_shape, num_blocks, block_size, torch.float32, "cpu",
                             extra_layers=model.num_mtp_layers)
    results = []
    for input_ids, positions, meta, previous in steps:
        hidden = model(input_ids, positions, cache.layers, meta)
        mtp_hidden = model.mtp_forward(0, input_ids, positions, previous, cache.layers[model.shape.num_layers], meta)
        results.append({"hidden": hidden, "logits": model.compute_logits(hidden), "mtp_hidden": mtp_hidden,
                        "mtp_logits": model.mtp_compute_logits(0, mtp_hidden)})
    return results


def main(port: str, rank: str, world_size: str, model_dir: str, steps_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", int(port), int(world_size), is_master=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = TPGroup(store, int(rank), int(world_size), torch.device("cpu"), TIMEOUT_S, hostname="127.0.0.1")
    model = load_model(model_dir, tp=group)
    steps, num_blocks, block_size = torch.load(steps_path, weights_only=False)
    torch.save(run_steps(model, steps, num_blocks, block_size), out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
