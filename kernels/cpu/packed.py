"""Linear weights repacked for the native (AVX2 or AVX-512) matmul: panels of 16 output columns, each ``[K, 16]``.

Packing happens once, after the checkpoint is loaded (``KernelOps.pack_weights``); the model then holds a
``PackedWeight`` where it held the ``[N, K]`` tensor, and only the native CPU ops ever receive one. A tied
embedding table is packed with the head and looked up from the panels, so the model keeps one copy of it.
"""

from __future__ import annotations

import attrs
import torch

PANEL = 16  # output columns per panel (kPanel in packed_linear.h)


def packed_numel(out_features: int, in_features: int) -> int:
    """Elements of a packed ``[out_features, in_features]`` weight: whole panels, the last one zero-padded."""
    return (out_features + PANEL - 1) // PANEL * in_features * PANEL


@attrs.frozen(eq=False)
class PackedWeight:
    """``packed[p, k, j] = weight[16 p + j, k]``, zero past ``out_features``."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's ``[out_features, in_features]``."""
        return (self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]`` (an embedding lookup) gathered from the panels."""
        return self.packed[ids // PANEL, :, ids % PANEL]

    def dense(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` tensor again (a copy)."""
        return self.packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()


def dense_weight(weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    """A projection weight as ``[out_features, in_features]``, whichever form the model holds it in."""
    return weight.dense() if isinstance(weight, PackedWeight) else weight
