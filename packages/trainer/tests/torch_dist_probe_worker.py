"""Run by test_ckpt_torch_dist_sharded.py as one rank: ddp_worker's loop with a probe.

Trains once per argv in the JSON list (one process group for all). Around every
torch_dist save and resume it records, per rank:

- `gathers`: calls of the distributed optimizer's gather path
  (`_gather_bucket_state`) and of the all-gather collectives
  (`all_gather_into_tensor`, `all_gather`) made during the save or resume;
- `rss_kib` / `peak_kib`: the resident set before and its peak during the call
  (the kernel's high-water mark, reset through /proc/self/clear_refs);
- `state_bytes`: the rank's resident training state (`memory_bytes()` of the
  distributed optimizer: parameters, gradients, main parameters, Adam state).

After a run with the distributed optimizer it also measures `state_dict()`,
the gathering path the `torch` format keeps, as a contrast (`gather_peak_kib`).
Rank 0 writes {"runs": [...], "probes": [rank][event]} to OUT.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.trainer import checkpointing_dist, training
from mg.trainer.arguments import parse_args
from mg.trainer.distributed import read_world_size

_CLEAR_REFS = Path("/proc/self/clear_refs")
_calls = {"active": False, "count": 0}
probes: list[dict[str, Any]] = []


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def _reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _counted(function: Callable) -> Callable:
    def spy(*args: Any, **kwargs: Any) -> Any:
        if _calls["active"]:
            _calls["count"] += 1
        return function(*args, **kwargs)

    return spy


@contextlib.contextmanager
def _probe(event: str, optimizer: Any) -> Iterator[None]:
    gc.collect()
    rss = _status_kib("VmRSS")
    resettable = _reset_peak()
    _calls.update(active=True, count=0)
    try:
        yield
    finally:
        _calls["active"] = False
        state = optimizer.memory_bytes() if isinstance(optimizer, DistributedOptimizer) else {}
        probes.append(
            {
                "event": event,
                "distributed_optimizer": isinstance(optimizer, DistributedOptimizer),
                "gathers": _calls["count"],
                "rss_kib": rss,
                "peak_kib": _status_kib("VmHWM") if resettable else None,
                "state_bytes": sum(state.values()),
            }
        )


def _install_spies() -> None:
    DistributedOptimizer._gather_bucket_state = _counted(DistributedOptimizer._gather_bucket_state)
    dist.all_gather_into_tensor = _counted(dist.all_gather_into_tensor)
    dist.all_gather = _counted(dist.all_gather)
    save, resume = checkpointing_dist.save, checkpointing_dist.resume

    def probed_save(*args: Any, **kwargs: Any) -> Any:
        with _probe("save", kwargs.get("optimizer")):
            return save(*args, **kwargs)

    def probed_resume(*args: Any, **kwargs: Any) -> Any:
        with _probe("resume", kwargs.get("optimizer")):
            return resume(*args, **kwargs)

    checkpointing_dist.save = probed_save
    checkpointing_dist.resume = probed_resume


def _contrast_with_gathering(optimizer: Any, since: int) -> None:
    """After a run that saved: the peak of the `torch` format's path (`state_dict()`
    gathers every bucket), collective over the data-parallel group."""
    saved = any(p["event"] == "save" for p in probes[since:])
    if not saved or not isinstance(optimizer, DistributedOptimizer):
        return
    gc.collect()
    rss, resettable = _status_kib("VmRSS"), _reset_peak()
    full = optimizer.state_dict()
    peak = _status_kib("VmHWM") if resettable else None
    del full
    probes.append({"event": "state_dict", "rss_kib": rss, "peak_kib": peak})


if __name__ == "__main__":
    out, argvs = sys.argv[1], json.loads(sys.argv[2])
    _install_spies()
    results = []
    for argv in argvs:
        since = len(probes)
        trainer = training.Trainer(parse_args(argv, world_size=read_world_size()))
        result = trainer.train()
        trainer.finish_saves()
        _contrast_with_gathering(trainer.optimizer, since)
        results.append({"losses": result.losses, "grad_norms": result.grad_norms})
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, probes)
    if trainer.env.rank == 0:
        Path(out).write_text(json.dumps({"runs": results, "probes": everyone}))
    dist.barrier()
    dist.destroy_process_group()
