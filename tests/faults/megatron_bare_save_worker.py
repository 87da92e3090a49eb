"""One rank of test_ckpt_megatron_core.py: megatron-core 0.16.1 on CPU (gloo) at TP=2.

    python megatron_bare_save_worker.py WORK

Builds Megatron's GPT for the config in WORK/config.json and saves it twice:

- WORK/bare/iter_0000005: a bare ``dist_checkpointing.save(model.sharded_state_dict())``,
  as megatron-core's run_simple_mcore_train_loop.py saves (no args, no iteration);
- WORK/lm/iter_0000010: as Megatron-LM's save_checkpoint with --no-save-optim (args with
  the NullTokenizer's, iteration, rng_state; no optimizer state).

Each with the tracker file beside it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from mg.ckpt_convert.megatron_lm import megatron_args_from_config
from mg.core.models import TransformerConfig
from mg.core.testing.megatron_dist_checkpoint import (
    dist_checkpointing_cpu_patches,
    save_like_megatron_lm,
)
from mg.core.testing.megatron_reference import megatron_cpu_patches, megatron_gpt_model
from mg.core.tokenizers.config import TokenizerConfig

_SHARED = Path(__file__).parents[2] / "packages/ckpt-convert/tests/megatron_parallel_worker.py"
_spec = importlib.util.spec_from_file_location("megatron_parallel_worker", _SHARED)
shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared)  # model_parallel: the layouts' helper


def main() -> None:
    work = Path(sys.argv[1])
    config = TransformerConfig.from_dict(json.loads((work / "config.json").read_text()))
    patches = megatron_cpu_patches()
    dist_checkpointing_cpu_patches(patches)
    dist.init_process_group("gloo")
    try:
        with shared.model_parallel(2, 1):
            torch.manual_seed(0)
            model = megatron_gpt_model(config)
            bare = work / "bare" / "iter_0000005"
            if dist.get_rank() == 0:
                bare.mkdir(parents=True)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), str(bare))
            dist.barrier()
            if dist.get_rank() == 0:
                (bare.parent / "latest_checkpointed_iteration.txt").write_text("5")
            tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=127)
            args = megatron_args_from_config(config, tokenizer, tp=2, pp=1)
            args.consumed_train_samples, args.ckpt_format = 40, "torch_dist"
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            save_like_megatron_lm(work / "lm", model, args, 10, position=(0, tp_rank), sizes=(1, 2))
    finally:
        dist.destroy_process_group()
        patches.undo()


if __name__ == "__main__":
    main()
