"""One rank of test_megatron_torch_dist_parallel.py: megatron-core 0.16.1 on CPU (gloo) in
the TP=2 and PP=2 layouts, one after the other (2 ranks).

    python megatron_torch_dist_worker.py WORK

For each config in WORK/configs.json and each layout it

- builds Megatron's model for this rank, perturbs it (noise keyed by the whole-model
  tensor name), saves it as Megatron-LM's `save_checkpoint` does with
  `--ckpt-format torch_dist` (WORK/<config>/megatron-<layout>/) and saves its logits;
- fills a fresh model with megatron-core's `dist_checkpointing.load` from the checkpoint
  mg-train wrote (WORK/<config>/mg-train/) and saves those logits.

Logits: each last-stage rank's vocabulary shard, <layout>-<megatron|mg-train>-tp<r>.pt.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mg.ckpt_convert.megatron_lm import megatron_args_from_config
from mg.core.models import TransformerConfig
from mg.core.testing.megatron_dist_checkpoint import (
    dist_checkpointing_cpu_patches,
    load_into_megatron,
    save_like_megatron_lm,
)
from mg.core.testing.megatron_reference import megatron_cpu_patches, megatron_gpt_model

ITERATION, CONSUMED = 10, 80
_SHARED = Path(__file__).parents[1] / "packages/ckpt-convert/tests/megatron_parallel_worker.py"
_spec = importlib.util.spec_from_file_location("megatron_parallel_worker", _SHARED)
shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared)  # model_parallel, perturb, forward: the layouts' helpers


def _megatron_rng_state(folder: Path, position: tuple[int, int], sizes: tuple[int, int]) -> list:
    """What Megatron-LM's `load_checkpoint` reads of `rng_state` for this rank (the
    ShardedObject `get_rng_state` describes), before taking entry [0] of the list."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    request = {"rng_state": ShardedObject("rng_state", None, sizes, position, replica_id=0)}
    return dist_checkpointing.load(request, str(folder))["rng_state"]


def main() -> None:
    work = Path(sys.argv[1])
    recorded = json.loads((work / "configs.json").read_text())
    configs = {name: TransformerConfig.from_dict(config) for name, config in recorded.items()}
    ids = torch.load(work / "ids.pt")
    patches = megatron_cpu_patches()
    dist_checkpointing_cpu_patches(patches)
    dist.init_process_group("gloo")
    try:
        for layout in ("tp2", "pp2"):
            tp, pp, _ = shared.LAYOUTS[layout]  # (tp, pp, ep): EP = 1 here
            with shared.model_parallel(tp, pp):
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
                for name, config in configs.items():
                    out = work / name
                    torch.manual_seed(0)
                    model = megatron_gpt_model(config)
                    shared.perturb(model, config, pp)
                    args = megatron_args_from_config(config, None, tp=tp, pp=pp)
                    args.consumed_train_samples, args.ckpt_format = CONSUMED, "torch_dist"
                    save_like_megatron_lm(
                        out / f"megatron-{layout}",
                        model,
                        args,
                        ITERATION,
                        position=(pp_rank, tp_rank),
                        sizes=(pp, tp),
                    )
                    written = shared.forward(model, ids, config.hidden_size)
                    (trained,) = (out / "mg-train").glob("iter_*")
                    fresh = megatron_gpt_model(config)
                    load_into_megatron(trained, fresh)
                    loaded = shared.forward(fresh, ids, config.hidden_size)
                    if written is not None:
                        torch.save(written, out / f"{layout}-megatron-tp{tp_rank}.pt")
                        torch.save(loaded, out / f"{layout}-mg-train-tp{tp_rank}.pt")
                    if name == "gpt2" and layout == "pp2":  # mg-train's layout: its generators
                        rng = _megatron_rng_state(trained, (pp_rank, tp_rank), (pp, tp))
                        torch.save(rng, out / f"rng-pp{pp_rank}-tp{tp_rank}.pt")
    finally:
        dist.destroy_process_group()
        patches.undo()


if __name__ == "__main__":
    main()
