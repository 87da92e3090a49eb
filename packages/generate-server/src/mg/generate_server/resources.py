"""What the server takes from the machine: CPU threads, bf16 support, the KV-cache pool's size."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn

from mg.core.models.paged_kv_cache import PagedKVCache
from mg.generate_server.errors import ServeSetupError
from mg.generate_server.memory_size import parse_memory

log = logging.getLogger("mg.generate_server")


def release_freed_heap() -> bool:
    """Give the heap freed at start-up back to the system before serving: glibc keeps
    freed chunks in its arenas, and loading a checkpoint and packing its linears (the
    packed copy replaces the plain weight) leave ~100 MB of them resident for a 135M
    bf16 model. Whether it ran (glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return False
    return True


def free_memory(device: torch.device) -> int:
    """Bytes the device can still give: the GPU's free memory, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pool_blocks(
    model: nn.Module,
    device: torch.device,
    kv_cache_memory: str | None,
    block_size: int,
    max_requests: int,
    max_length: int,
    fp8: bool = False,
) -> int:
    """How many KV-cache blocks to allocate (`--kv-cache-memory`, else the default in its help)."""
    block_bytes = PagedKVCache.block_bytes(model, block_size, fp8=fp8)
    per_sequence = -(-max_length // block_size)
    if block_bytes == 0:  # no attention layers (Mamba-2): the blocks only count positions
        return max_requests * per_sequence
    free = free_memory(device)
    if kv_cache_memory is None:
        blocks = min(max_requests * per_sequence, free // 2 // block_bytes)
        what = "the default pool (half the free memory at most)"
    else:
        budget = parse_memory(kv_cache_memory)
        if isinstance(budget, float):
            budget = int(budget * free)
        blocks = budget // block_bytes
        what = f"--kv-cache-memory {kv_cache_memory}"
    if blocks < per_sequence:
        raise ServeSetupError(
            f"{what} holds {blocks} KV-cache blocks of {block_size} positions "
            f"({block_bytes} bytes each) but one sequence of {max_length} positions needs "
            f"{per_sequence}; give more memory or lower --inference-max-seq-length"
        )
    log.debug(
        "KV cache: %d blocks x %d positions, %.1f MiB",
        blocks,
        block_size,
        blocks * block_bytes / 2**20,
    )
    return blocks


def set_threads(requested: int | None, device: torch.device) -> int:
    """Set torch's intra-op threads: `--num-threads`, else the cores this process may use
    shared among the ranks on this machine (torchrun's LOCAL_WORLD_SIZE)."""
    if requested is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
        requested = max(1, cores // max(1, ranks))
    torch.set_num_threads(requested)
    log.debug("using %d CPU threads", requested)  # the start-up line says it
    return requested


def check_cpu_bf16() -> None:
    """--bf16 on a CPU needs bfloat16 instructions; without them it is slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return  # not Linux: let torch decide
    if not re.search(r"\b(avx512_bf16|amx_bf16|bf16)\b", flags):
        raise ServeSetupError(
            "--bf16: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16 or Arm bf16); "
            "serve in fp32 by dropping the flag"
        )
