"""DeepSeek-V3's feed-forward blocks: a gated (SwiGLU) MLP and the mixture of experts built from them.

The router follows ``transformers``' ``DeepseekV3TopkRouter`` step for step: sigmoid scores of a float32 gate; the
``e_score_correction_bias`` added for choosing experts only; experts chosen within the ``topk_group`` best of
``n_group`` groups (a group's score is the sum of its two best biased scores); the chosen experts' unbiased scores,
renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``, weight their outputs. The gate and the bias
stay float32 whatever the model dtype (as transformers keeps them), and the weighted expert outputs are summed in
float32 before the cast back, as its grouped-matmul experts do, so bfloat16 rounds where it rounds.

Under tensor parallelism (``tp``) the router stays whole on every rank (each picks the same experts, from the same
all-reduced input); every routed expert and the shared experts are split over their MLP size, gate/up
column-parallel and down row-parallel, so a rank holds ``1/N`` of each expert and computes a partial output of every
chosen one. The routed sum and the shared experts' partial output are added first and all-reduced once per layer.
A dense layer's ``GatedMLP`` splits the same way and all-reduces its own output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ksana.kernels.dispatch import KernelOps
from ksana.models.base import WeightSlot
from ksana.models.parallel import Shard, TPGroup, rank_and_size


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul (a dense layer, the shared experts).

    Under tensor parallelism this rank's ``intermediate_size / N`` slice; ``reduce`` all-reduces the output (a dense
    layer), else the caller adds the partial output to others before one all-reduce (the shared experts).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, ops: KernelOps,
                 device: torch.device, tp: TPGroup | None = None, reduce: bool = True):
        super().__init__()
        self.ops = ops
        self.rank, num_ranks = rank_and_size(tp)
        self.sharded = tp is not None
        self.all_reduce = tp.all_reduce if tp is not None and reduce else None
        self.size = intermediate_size // num_ranks
        self.gate_up_weight = empty_param((2 * self.size, hidden_size), dtype, device)
        self.down_weight = empty_param((hidden_size, self.size), dtype, device)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        return {
            f"{prefix}.gate_proj.weight": WeightSlot(self.gate_up_weight, 0, self.size),
            f"{prefix}.up_proj.weight": WeightSlot(self.gate_up_weight, self.size, self.size),
            f"{prefix}.down_proj.weight": WeightSlot(self.down_weight),
        }

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        """The part of each checkpoint tensor this rank reads (empty without tensor parallelism)."""
        if not self.sharded:
            return {}
        rows, columns = Shard(0, self.rank * self.size, self.size), Shard(1, self.rank * self.size, self.size)
        return {f"{prefix}.gate_proj.weight": rows, f"{prefix}.up_proj.weight": rows,
                f"{prefix}.down_proj.weight": columns}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.mlp_gate_up(hidden, self.gate_up_weight)
        out = self.ops.mlp_down(self.ops.silu_and_mul(gate_up), self.down_weight)
        return out if self.all_reduce is None else self.all_reduce(out)


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts. The experts' weights lie in two 2-D tensors, expert ``e``'s gate/up
    rows at ``e * 2I`` and its down rows at ``e * hidden``, so each checkpoint tensor is one row range (``I`` is
    this rank's part of ``moe_intermediate_size`` under tensor parallelism)."""

    def __init__(self, config: Any, dtype: torch.dtype, ops: KernelOps, device: torch.device,
                 tp: TPGroup | None = None):
        super().__init__()
        self.ops = ops
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.hidden_size = hidden = config.hidden_size
        self.rank, num_ranks = rank_and_size(tp)
        self.sharded = tp is not None
        self.all_reduce = None if tp is None else tp.all_reduce
        self.expert_size = size = config.moe_intermediate_size // num_ranks
        if self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} routed experts do not divide into n_group={self.num_groups}")
        self.gate_weight = empty_param((self.num_experts, hidden), torch.float32, device)
        self.score_bias = empty_param((self.num_experts,), torch.float32, device)
        self.experts_gate_up = empty_param((self.num_experts * 2 * size, hidden), dtype, device)
        self.experts_down = empty_param((self.num_experts * hidden, size), dtype, device)
        num_shared = config.n_shared_experts or 0
        self.shared = (GatedMLP(hidden, config.moe_intermediate_size * num_shared, dtype, ops, device, tp,
                                reduce=False) if num_shared else None)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        size, hidden = self.expert_size, self.hidden_size
        slots = {f"{prefix}.gate.weight": WeightSlot(self.gate_weight),
                 f"{prefix}.gate.e_score_correction_bias": WeightSlot(self.score_bias)}
        for e in range(self.num_experts):
            expert = f"{prefix}.experts.{e}"
            slots[f"{expert}.gate_proj.weight"] = WeightSlot(self.experts_gate_up, 2 * size * e, size)
            slots[f"{expert}.up_proj.weight"] = WeightSlot(self.experts_gate_up, 2 * size * e + size, size)
            slots[f"{expert}.down_proj.weight"] = WeightSlot(self.experts_down, hidden * e, hidden)
        if self.shared is not None:
            slots |= self.shared.weight_slots(f"{prefix}.shared_experts")
        return slots

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        """This rank's slice of every expert (and of the shared experts); the router is read whole."""
        if not self.sharded:
            return {}
        size = self.expert_size
        rows, columns = Shard(0, self.rank * size, size), Shard(1, self.rank * size, size)
        shards = {}
        for e in range(self.num_experts):
            expert = f"{prefix}.experts.{e}"
            shards |= {f"{expert}.gate_proj.weight": rows, f"{expert}.up_proj.weight": rows,
                       f"{expert}.down_proj.weight": columns}
        if self.shared is not None:
            shards |= self.shared.weight_shards(f"{prefix}.shared_experts")
        return shards

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert ids [T, top_k], their weights [T, top_k] float32)``."""
        scores = F.linear(hidden.float(), self.gate_weight).sigmoid()
        for_choice = scores + self.score_bias
        grouped = for_choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
        for_choice = for_choice.masked_fill(~expert_mask, float("-inf"))
        ids = for_choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(hidden)
        out = self._experts(hidden, ids, weights)
        if self.shared is not None:
            out = out + self.shared(hidden)
        return out if self.all_reduce is None else self.all_reduce(out)

    def _experts(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once over the rows that chose it; ``[T, hidden]`` in ``hidden``'s dtype."""
        num_tokens = hidden.shape[0]
        flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
        out = torch.zeros((flat_ids.numel(), self.hidden_size), dtype=torch.float32, device=hidden.device)
        order = flat_ids.argsort()
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        gate_up = self.experts_gate_up.view(self.num_experts, 2 * self.expert_size, self.hidden_size)
        down = self.experts_down.view(self.num_experts, self.hidden_size, self.expert_size)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = order[start : start + count]
            start += count
            x = hidden[rows // self.top_k]
            y = self.ops.mlp_down(self.ops.silu_and_mul(self.ops.mlp_gate_up(x, gate_up[expert])), down[expert])
            out[rows] = y.float() * flat_weights[rows, None]
        return out.view(num_tokens, self.top_k, self.hidden_size).sum(dim=1).to(hidden.dtype)
