"""Megatron-style tensor parallelism: the process group a rank talks through and how weights are split.

- QKV is column-parallel by KV-head group: rank r holds query heads ``r*H/N ..`` and the KV heads they read,
  so grouped-query attention stays whole on each rank and the KV cache holds ``KV/N`` heads per rank.
- gate/up are column-parallel, o_proj and down row-parallel; each row-parallel matmul is followed by an
  all-reduce (its bias is added on rank 0 only, so the sum carries it once).
- Embedding and lm_head are vocabulary-parallel: ``ceil(V/N)`` rows per rank (the last rank's tail is zero
  padding); the embedding all-reduces masked lookups, lm_head all-gathers the logit slices.
- Multi-head latent attention (DeepSeek-V3) splits its query heads: the latent and the rope key, which every head
  reads, are computed and cached whole on every rank (``q_a``/``kv_a`` replicated); ``q_b_proj``/``q_proj`` and
  ``kv_b_proj`` are column-parallel by head, ``o_proj`` row-parallel. A mixture of experts keeps its router
  whole and splits every expert (and the shared experts) over the MLP size, with one all-reduce for their sum.

A ``Shard`` names the part of a checkpoint tensor a rank reads, so the loader reads only that part.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ksana.config import ConfigError
from ksana.models.shape import ModelShape

TP_SIZE_KEY = "setting.global.tensor_para_size"


class CollectiveError(RuntimeError):
    """A collective failed: usually a peer rank died or raised (its own error says why)."""


@attrs.frozen
class Shard:
    """Read ``[start, start + size)`` of the checkpoint tensor along ``dim`` (0: rows, 1: columns)."""

    dim: int
    start: int
    size: int


def check_tp_size(shape: ModelShape, tp_size: int) -> None:
    """Refuse sizes the split cannot serve, naming the config key (before any process is started)."""
    if tp_size < 1:
        raise ConfigError(f"config key '{TP_SIZE_KEY}' must be at least 1, got {tp_size}")
    if tp_size == 1:
        return
    problems = []
    # Multi-head latent attention has one latent "head" that every rank caches whole: no KV heads to divide.
    if not shape.is_mla and shape.num_kv_heads < tp_size:
        problems.append(
            f"more ranks ({tp_size}) than KV heads ({shape.num_kv_heads}): replicating KV heads is not supported"
        )
    elif not shape.is_mla and shape.num_kv_heads % tp_size:
        problems.append(f"the {shape.num_kv_heads} KV heads do not divide into {tp_size} ranks")
    if shape.num_heads % tp_size:
        problems.append(f"the {shape.num_heads} attention heads do not divide into {tp_size} ranks "
                        "(num_attention_heads)")
    if shape.has_dense_mlp and shape.intermediate_size % tp_size:
        problems.append(f"the MLP size {shape.intermediate_size} does not divide into {tp_size} ranks "
                        "(intermediate_size)")
    if shape.moe_intermediate_size % tp_size:
        problems.append(f"the expert MLP size {shape.moe_intermediate_size} does not divide into {tp_size} ranks "
                        "(moe_intermediate_size)")
    if problems:
        raise ConfigError(f"config key '{TP_SIZE_KEY}' = {tp_size} is invalid for this model: "
                          + "; ".join(problems))


def rank_shape(shape: ModelShape, rank_count: int) -> ModelShape:
    """The per-rank sizes (heads, KV heads, MLP, expert MLP); the KV cache of a rank is allocated from this.

    A multi-head latent attention model keeps its one latent "head" (``kv_cache_heads`` 1, ``kv_lora_rank`` and
    ``qk_rope_head_dim`` wide): every rank caches the whole latent, which all of its query heads read.
    """
    if rank_count == 1:
        return shape
    return attrs.evolve(
        shape,
        num_heads=shape.num_heads // rank_count,
        num_kv_heads=shape.num_kv_heads if shape.is_mla else shape.num_kv_heads // rank_count,
        intermediate_size=shape.intermediate_size // rank_count,
        moe_intermediate_size=shape.moe_intermediate_size // rank_count,
    )


def rank_and_size(tp: TPGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``tp``; ``(0, 1)`` without tensor parallelism."""
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """``(start, num_rows, rows_per_rank)``: this rank's real vocabulary rows and the padded per-rank count."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


def vocab_parallel_embedding(embedding: Any, input_ids: torch.Tensor, table: torch.Tensor, vocab_start: int,
                             num_rows: int, all_reduce: Any) -> torch.Tensor:
    """``embedding(ids, table)`` of a vocabulary split across ranks: each rank looks up the ids in its range and
    zeros the rest; the sum over ranks (``all_reduce``) is the lookup. Without ``all_reduce``, the plain lookup."""
    if all_reduce is None:
        return embedding(input_ids, table)
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= num_rows)
    hidden = embedding(local.masked_fill(outside, 0), table)
    return all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0).contiguous())


def gathered_logits(lm_head: Any, hidden: torch.Tensor, head: torch.Tensor, vocab_size: int,
                    all_gather: Any) -> torch.Tensor:
    """float32 ``[N, vocab_size]`` logits of a head split by vocabulary rows: each rank's slice, gathered, cut to
    the vocabulary (the last rank's padding rows dropped). Without ``all_gather``, the plain head."""
    logits = lm_head(hidden, head).float()
    if all_gather is None:
        return logits
    return all_gather(logits)[:, :vocab_size]


class TPGroup:
    """One rank's view of the tensor-parallel process group (gloo on CPU, NCCL on CUDA).

    A process-group object rather than torch's global default group, so one process can hold several engines
    one after another (tests) and nothing global is left behind.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout_s: float = 600.0, hostname: str | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.store = store
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("ksana/tp/pg", store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            if hostname is not None:
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            else:
                options._devices = [dist.ProcessGroupGloo.create_default_device()]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveError(f"tensor-parallel {what} failed on rank {self.rank}: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self._wait(self.pg.allreduce([tensor]), "all-reduce")
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dimension, in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([parts], [tensor]), "all-gather")
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; the length goes first so receivers can size the buffer)."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        on_device = self.device.type == "cuda"
        self._broadcast(length, on_device)
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        payload = self._broadcast(payload, on_device)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor, on_device: bool) -> torch.Tensor:
        work = tensor.to(self.device) if on_device else tensor
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self.pg.broadcast([work], options), "broadcast")
        if on_device:
            tensor.copy_(work.cpu())
        return tensor
