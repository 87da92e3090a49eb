"""One rank of test_megatron_parallel_compat.py (and test_megatron_moe.py's parallel
cases): megatron-core's GPTModel in the given layouts, one after the other, on CPU with
gloo (launched by mg.core.testing.launch with as many ranks as the largest layout needs;
tp2 and pp2 by default; ep2 and tp2ep2 are expert-parallel layouts of MoE configs).

    python megatron_parallel_worker.py WORK [tp2] [pp2] [tp2pp2] [ep2] [tp2ep2]

For each config in WORK/configs.json and each layout it

- builds Megatron's model for this rank, perturbs it (noise keyed by the whole-model
  tensor name, so replicated tensors and the last stage's tied embedding copy agree
  across ranks), saves it exactly as Megatron-LM's save_checkpoint lays it out
  (WORK/<config>/written-<layout>/, pickled Namespace args) and saves its logits;
- loads the rank file mg-convert exported (WORK/<config>/exported-<layout>/) strictly
  into a fresh model and saves those logits.

Logits: each last-stage rank's vocabulary shard (GPTModel's parallel output), saved as
<layout>-<written|exported>-tp<tensor rank>.pt; a first stage sends its hidden states on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import megatron.core.models.gpt.gpt_model as gpt_model
import megatron.core.transformer.transformer_config as transformer_config
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mg.ckpt_convert.megatron_lm import megatron_args_from_config
from mg.core.models import TransformerConfig
from mg.core.testing.megatron_reference import megatron_cpu_patches, megatron_gpt_model

# name → (TP, PP, EP); expert tensor parallelism = TP (Megatron's default)
LAYOUTS = {
    "tp2": (2, 1, 1),
    "pp2": (1, 2, 1),
    "tp2pp2": (2, 2, 1),
    "ep2": (1, 1, 2),
    "tp2ep2": (2, 1, 2),
}
ITERATION = 10
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@contextlib.contextmanager
def model_parallel(tp: int, pp: int, ep: int = 1) -> Iterator[None]:
    """parallel_state for TP x PP (x EP); core's megatron_gpt_model builds this rank's part."""
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    patches = pytest.MonkeyPatch()
    if ep > 1:
        patches.setattr(
            transformer_config,
            "TransformerConfig",
            functools.partial(
                transformer_config.TransformerConfig,
                expert_model_parallel_size=ep,
                tensor_model_parallel_size=tp,  # (no sequence parallelism: torch norms)
            ),
        )
    if pp > 1:
        staged_config = functools.partial(
            transformer_config.TransformerConfig,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
        )
        staged_model = functools.partial(
            gpt_model.GPTModel, pre_process=stage == 0, post_process=stage == pp - 1
        )
        patches.setattr(transformer_config, "TransformerConfig", staged_config)
        patches.setattr(gpt_model, "GPTModel", staged_model)
    try:
        yield
    finally:
        patches.undo()
        parallel_state.destroy_model_parallel()


def perturb(model: torch.nn.Module, config: TransformerConfig, pp: int) -> None:
    """Noise seeded by each parameter's whole-model name (norms and biases off 1/0)."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    offset = stage * config.num_layers // pp
    tied = not config.untie_embeddings_and_output_weights
    with torch.no_grad():
        for name, param in model.named_parameters():
            match = _LAYER.match(name)
            if match:
                name = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
            elif name == "output_layer.weight" and tied:
                name = "embedding.word_embeddings.weight"
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def forward(model: torch.nn.Module, ids: torch.Tensor, hidden_size: int) -> torch.Tensor | None:
    """Logits on the ranks that compute them; a pipeline's first stage sends its output on."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(ids.shape[1], ids.shape[0], hidden_size)  # [s, b, h]
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, positions, None)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        return out


def rank_dir(tp: int, pp: int, ep: int = 1) -> str:
    """Megatron-LM's mp_rank_TT[_PPP][_EEE] for this rank."""
    t = parallel_state.get_tensor_model_parallel_rank()
    p = parallel_state.get_pipeline_model_parallel_rank()
    e = parallel_state.get_expert_model_parallel_rank()
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def save_as_megatron(
    folder: Path, model: torch.nn.Module, config: TransformerConfig, tp, pp, ep=1
) -> None:
    args = megatron_args_from_config(config, None, tp=tp, pp=pp, ep=ep)
    args.lr, args.micro_batch_size = 3e-4, 4
    path = folder / f"iter_{ITERATION:07d}" / rank_dir(tp, pp, ep) / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)  # data-parallel replicas write it alike
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.state_dict(),
        "rng_state": [{"random_rng_state": (3, (1, 2), None)}],
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (folder / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def load_exported(folder: Path, model: torch.nn.Module, tp: int, pp: int, ep: int = 1) -> None:
    (iteration,) = [d for d in folder.iterdir() if d.name.startswith("iter_")]
    path = iteration / rank_dir(tp, pp, ep) / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    result = model.load_state_dict(state["model"], strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys), result.missing_keys


def main() -> None:
    work = Path(sys.argv[1])
    recorded = json.loads((work / "configs.json").read_text())
    configs = {name: TransformerConfig.from_dict(config) for name, config in recorded.items()}
    ids = torch.load(work / "ids.pt")
    layouts = sys.argv[2:] or ["tp2", "pp2"]
    patches = megatron_cpu_patches()
    dist.init_process_group("gloo")
    try:
        for layout in layouts:
            tp, pp, ep = LAYOUTS[layout]
            with model_parallel(tp, pp, ep):
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                for name, config in configs.items():
                    out = work / name
                    torch.manual_seed(0)
                    model = megatron_gpt_model(config)
                    perturb(model, config, pp)
                    save_as_megatron(out / f"written-{layout}", model, config, tp, pp, ep)
                    written = forward(model, ids, config.hidden_size)
                    fresh = megatron_gpt_model(config)
                    load_exported(out / f"exported-{layout}", fresh, tp, pp, ep)
                    exported = forward(fresh, ids, config.hidden_size)
                    if written is not None and parallel_state.get_data_parallel_rank() == 0:
                        torch.save(written, out / f"{layout}-written-tp{tp_rank}.pt")
                        torch.save(exported, out / f"{layout}-exported-tp{tp_rank}.pt")
    finally:
        dist.destroy_process_group()
        patches.undo()


if __name__ == "__main__":
    main()
