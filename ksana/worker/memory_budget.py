"""Sizing the KV pool from ``setting.block_manager``: an explicit count, or a ratio of the memory left."""

from __future__ import annotations

import logging

import torch

from ksana.config import BlockManagerSetting

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now (after the weights are loaded): device memory on an accelerator, MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def plan_num_blocks(setting: BlockManagerSetting, bytes_per_block: int, device: torch.device,
                    max_useful_blocks: int, unloaded_weight_bytes: int = 0) -> int:
    """How many blocks the pool gets; never more than could ever be in use at once (``max_useful_blocks``).
    ``unloaded_weight_bytes``: weights still to load, taken off the free memory (the simulator loads none)."""
    if setting.num_device_blocks > 0:
        return setting.num_device_blocks
    free = max(0, available_memory_bytes(device) - unloaded_weight_bytes)
    usable = free * (1.0 - setting.reserved_device_memory_ratio) * setting.block_device_memory_ratio
    num_blocks = min(int(usable // bytes_per_block), max_useful_blocks)
    if num_blocks < 1:
        raise RuntimeError(
            f"no room for the KV cache: {free / 2**20:.0f} MiB free, one block needs {bytes_per_block} bytes; "
            "raise setting.block_manager.block_device_memory_ratio or set num_device_blocks"
        )
    return num_blocks
