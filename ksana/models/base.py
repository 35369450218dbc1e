"""The interface every model family implements, and how it exposes its parameters to the loader."""

from __future__ import annotations

import attrs
import torch

from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.models.parallel import Shard
from ksana.models.shape import ModelShape


@attrs.frozen
class WeightSlot:
    """Where one checkpoint tensor goes: rows ``start : start + num_rows`` of ``param`` (all of it if None).

    Fused parameters (qkv, gate/up) have one slot per checkpoint tensor, each a row range.
    """

    param: torch.Tensor
    start: int = 0
    num_rows: int | None = None

    def target(self) -> torch.Tensor:
        return self.param if self.num_rows is None else self.param.narrow(0, self.start, self.num_rows)


class CausalLM(torch.nn.Module):
    """A causal language model over a paged KV cache.

    ``forward`` takes the packed tokens of a batch (see ``AttentionMetadata``) and returns their final hidden
    states ``[T, hidden]``; the runner picks the rows it samples from and calls ``compute_logits`` on them.
    """

    shape: ModelShape
    layer_forward_round: int = 1

    def set_layer_forward_round(self, num_rounds: int) -> None:
        """Run each decoder layer ``num_rounds`` times per forward (KsanaLLM's ``layer_forward_round``, perf mode):
        the cost of a model that deep, with the same outputs, since every repeat recomputes the layer on the same
        input. A model's ``forward`` reads ``self.layer_forward_round``."""
        if num_rounds < 1:
            raise ValueError(f"layer_forward_round must be at least 1, got {num_rounds}")
        self.layer_forward_round = num_rounds

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits."""
        raise NotImplementedError

    @property
    def kv_head_major(self) -> bool:
        """Whether the KV cache this model reads should be head-major (see ``KVCache``): its kernels' choice."""
        return False

    def compute_greedy(self, hidden: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """Greedy decoding's token and log-probability per row, where the model's kernels get them without the
        logits (what the sampler's greedy fast path gives on ``compute_logits``); None: use the logits."""
        return None

    def weight_slots(self) -> dict[str, WeightSlot]:
        """Checkpoint tensor name -> destination, for every tensor the model needs."""
        raise NotImplementedError

    def ignored_weight_names(self) -> frozenset[str]:
        """Checkpoint tensors that are expected but unused (e.g. a tied ``lm_head.weight``)."""
        return frozenset()

    def stack_weight_slots(self) -> dict[str, WeightSlot]:
        """The slots of a Hugging Face decoder stack: the vocabulary-parallel embedding (and untied head), each of
        ``self.layers`` under ``model.layers.{i}``, the final norm. For families that hold ``embed_weight``,
        ``layers``, ``norm_weight``, ``lm_head_weight``, ``tied``, ``tp`` and ``num_vocab_rows``."""
        rows = None if self.tp is None else self.num_vocab_rows
        slots = {"model.embed_tokens.weight": WeightSlot(self.embed_weight, 0, rows)}
        for i, layer in enumerate(self.layers):
            slots |= layer.weight_slots(f"model.layers.{i}")
        slots["model.norm.weight"] = WeightSlot(self.norm_weight)
        if not self.tied:
            slots["lm_head.weight"] = WeightSlot(self.lm_head_weight, 0, rows)
        return slots

    def stack_weight_shards(self) -> dict[str, Shard]:
        """This tensor-parallel rank's parts of ``stack_weight_slots``' tensors (none without tensor parallelism):
        its rows of the embedding and head, and each layer's own shards."""
        if self.tp is None:
            return {}
        vocab = Shard(0, self.vocab_start, self.num_vocab_rows)
        shards = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
        for i, layer in enumerate(self.layers):
            shards |= layer.weight_shards(f"model.layers.{i}")
        return shards

    def fill_missing_weights(self, missing: set[str]) -> set[str]:
        """Given the slots the checkpoint did not fill, stand in for those the model can do without (an optional
        module it then drops, a copy of a tensor it already holds); returns the names still missing."""
        return missing

    def tie_lm_head(self) -> None:
        """Share the input embedding as output projection (checkpoint without ``lm_head.weight``)."""
        raise NotImplementedError

    def pack_weights(self) -> None:
        """Once the weights are loaded: put them in the layout the device's kernels read fastest (a no-op where
        the kernels take the checkpoint's layout)."""
