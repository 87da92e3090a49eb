"""How a model is built for a run: a family's plain model, then one ordered list of steps.

A family builds a plain PyTorch model (on the meta device where it can), which
knows no process groups. `construct` then runs the steps below, in this order
and no other, each one the function of one technique, in its own module. The
order is written down once, here; what a step needs before it and what it
forbids after it is in its entry. A step changes modules by swapping them or
their classes (`mg.core.models.subclass`), never by assigning `forward`, so a
later step sees what an earlier one left: recompute wraps whatever attention
Transformer Engine put in place.

| # | step | applies when |
| --- | --- | --- |
| 1 | vocab mask | `real_vocab_size` (--mask-padded-vocab) |
| 2 | cross-entropy fusion | `cross_entropy_fusion` (--cross-entropy-loss-fusion) |
| 3 | FP8 linears (torchao) | `float8` (--fp8-format with --transformer-impl local) |
| 4 | tensor parallel | tp > 1 |
| 5 | context parallel | cp > 1 |
| 6 | pipeline split | pp > 1 |
| 7 | materialize | always (storage for a meta model, or `.to(device)`; under FSDP at 13) |
| 8 | expert parallel | experts live apart (ep > 1 or an etp below tp) |
| 9 | MoE aux-loss groups | more than one rank per pipeline stage |
| 10 | Transformer Engine | `transformer_engine` (--transformer-impl transformer_engine) |
| 11 | recompute | `recompute` (--recompute-*) / `moe_layer_recompute` |
| 12 | compile | `compile` (--torch-compile) |
| 13 | fully sharded data parallel | `fully_sharded` (--use-megatron-fsdp), dp × cp > 1 |

Evaluation and serving read a checkpoint into their layout through the same
function with `LOADING_STEPS` (their subset); a dense upcycling twin runs it
with fewer options set. Data parallelism (DDP or the distributed optimizer) wraps
the result afterwards, in the trainer; fully sharded data parallelism is a step
instead, since the optimizer must be built over the shards it leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mg.core.models.compile import compile_layers
from mg.core.models.float8_training import convert_to_float8
from mg.core.models.fused_cross_entropy import apply_cross_entropy_fusion
from mg.core.models.moe import TopKRouter
from mg.core.models.recompute import (
    apply_activation_recompute,
    apply_moe_layer_recompute,
    apply_recompute_modules,
)
from mg.core.models.retro import RetroModel
from mg.core.models.te_parallel import TEParallelism
from mg.core.models.te_spec import FP8Options, apply_transformer_engine
from mg.core.models.vision import LLaVAModel
from mg.core.models.vocab_mask import set_real_vocab_size
from mg.core.parallel.context_parallel import apply_context_parallel
from mg.core.parallel.expert_parallel import apply_expert_parallel
from mg.core.parallel.fully_sharded import (
    FullyShardedOptions,
    apply_fully_shard,
    data_parallel_mesh,
)
from mg.core.parallel.layout import ParallelLayout
from mg.core.parallel.materialize import materialize, to_keeping_marks
from mg.core.parallel.pipeline import PipelineChunk, split_model
from mg.core.parallel.pipeline_vision import split_llava_model
from mg.core.parallel.tensor_parallel import apply_tensor_parallel
from mg.core.parallel.tensor_parallel_retro import apply_retro_tensor_parallel
from mg.core.parallel.tensor_parallel_vision import apply_llava_tensor_parallel


class PipelineModel(nn.ModuleList):
    """This rank's model chunks (one, or several with the interleaved schedule)."""

    @property
    def chunks(self) -> list[PipelineChunk]:
        return list(self)


@dataclass(frozen=True)
class RecomputeOptions:
    """Megatron's activation recompute: `granularity` selective (of `modules`, Megatron's
    recompute_modules names, `mg.core.models.recompute.apply_recompute_modules`) or full
    (`method` uniform or block over `num_layers`)."""

    granularity: str = "selective"
    method: str = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ("core_attn",)


@dataclass(frozen=True)
class ConstructOptions:
    """What the steps need; an option left at its default leaves its step out."""

    layout: ParallelLayout
    device: torch.device
    seed: int = 1234
    init_device: torch.device | None = None
    """Where a meta model's full-size units are drawn (None: the CPU)."""
    perform_initialization: bool = True
    real_vocab_size: int | None = None
    cross_entropy_fusion: bool = False
    recompute: RecomputeOptions | None = None
    moe_layer_recompute: bool = False
    transformer_engine: bool = False
    fp8: FP8Options | None = None
    """FP8 in Transformer Engine's layers (its `fp8_autocast`)."""
    float8: FP8Options | None = None
    """FP8 in torchao's float8 linears (`mg.core.models.float8_training`)."""
    float8_emulate: bool = False
    """torchao's FP8 rounding with high-precision matmuls (machines without FP8 matmuls)."""
    compile: bool = False
    fully_sharded: FullyShardedOptions | None = None


@dataclass
class UnderConstruction:
    """The model as the steps hand it on: the whole model (the pipeline split keeps
    it whole: expert parallelism walks all its layers) and this rank's parts."""

    model: nn.Module
    parts: list[nn.Module] = field(default_factory=list)
    on_meta: bool = False

    def result(self, layout: ParallelLayout) -> nn.Module:
        return self.model if layout.pp == 1 else PipelineModel(self.parts)


# --- the steps, one function each ----------------------------------------------------------


def mask_padded_vocab(built: UnderConstruction, options: ConstructOptions) -> None:
    """The loss's softmax over the tokenizer's rows only. Before the pipeline split
    (each chunk takes the model's size)."""
    set_real_vocab_size(built.model, options.real_vocab_size)


def fuse_cross_entropy(built: UnderConstruction, options: ConstructOptions) -> None:
    """The output layer and loss fused. Before tensor parallelism, which refuses it (its
    loss is vocab-parallel), and before the split (the last chunk takes the model's)."""
    apply_cross_entropy_fusion(built.model)


def shard_tensor_parallel(built: UnderConstruction, options: ConstructOptions) -> None:
    """Megatron's column/row sharding as DTensors. On the whole model, before the split
    and before materializing (a meta model's shards get storage there)."""
    layout = options.layout
    if isinstance(built.model, RetroModel):  # its cross-attention's own plan
        seed = layout.tensor_parallel_seed(options.seed)
        apply_retro_tensor_parallel(
            built.model, layout.tp_mesh, layout.sequence_parallel, seed, options.device
        )
        return
    if isinstance(built.model, LLaVAModel):  # both towers, the projector, the language model
        seed = layout.tensor_parallel_seed(options.seed)
        apply_llava_tensor_parallel(
            built.model, layout.tp_mesh, layout.sequence_parallel, seed, options.device
        )
        return
    apply_tensor_parallel(
        built.model,
        layout.tp_mesh,
        layout.sequence_parallel,
        seed=layout.tensor_parallel_seed(options.seed),
        device=options.device,
        expert_tensor_parallel=layout.etp > 1,
        expert_mesh=layout.etp_mesh,
    )


def ring_attention(built: UnderConstruction, options: ConstructOptions) -> None:
    """Context parallelism: every causal SDPA core attention becomes a ring. After
    tensor parallelism; before Transformer Engine, which takes over the cp group
    itself (TE's attention is told it) and before recompute (which then wraps the ring)."""
    apply_context_parallel(built.model, options.layout.cp_group, options.layout.tp_cp_group)


def split_pipeline(built: UnderConstruction, options: ConstructOptions) -> None:
    """This rank's chunks of layers. After every step that needs the whole model's
    layers in one piece (tensor and context parallelism, the fused loss)."""
    layout = options.layout
    if isinstance(built.model, LLaVAModel):  # the towers on the first stage
        built.parts = split_llava_model(built.model, layout.pp_rank, layout.pp, layout.virtual)
        return
    built.parts = split_model(built.model, layout.pp_rank, layout.pp, layout.virtual)


def float8_linears(built: UnderConstruction, options: ConstructOptions) -> None:
    """The decoder layers' linears as torchao's `Float8Linear`s. Before tensor parallelism
    (its styles must see the new modules, which are `nn.Linear`s) and FSDP (FP8 weight
    all-gather is set up by the module swap)."""
    assert options.float8 is not None
    convert_to_float8(
        built.model,
        options.float8,
        emulate=options.float8_emulate,
        fsdp_all_gather=options.float8.param and options.fully_sharded is not None,
    )


def give_storage(built: UnderConstruction, options: ConstructOptions) -> None:
    """Storage on the rank's device for what this rank holds, initialised to the single-
    process model's values (`mg.core.parallel.materialize`). After the split: a rank
    allocates its stage only. Steps after it see real tensors, except under FSDP: a meta
    model is given storage by the fully sharded step, for its shards only."""
    if storage_waits_for_fsdp(built, options):
        return
    _give_storage(built, options)


def _give_storage(built: UnderConstruction, options: ConstructOptions) -> None:
    if built.on_meta:
        materialize(
            built.parts,
            built.model.config,
            options.device,
            init_device=options.init_device,
            perform_initialization=options.perform_initialization,
        )
    else:  # keeping the tied copy's mark (DTensor parameters become new objects)
        for part in built.parts:
            to_keeping_marks(part, options.device)


def keep_own_experts(built: UnderConstruction, options: ConstructOptions) -> None:
    """Each rank keeps its experts and routes tokens over the expert-parallel group.
    After materializing (it drops experts that have storage)."""
    layout = options.layout
    apply_expert_parallel(
        built.model,
        layout.ep_group,
        built.model.config.moe_token_dispatcher_type,
        experts_apart=True,
    )


def share_aux_loss_counts(built: UnderConstruction, options: ConstructOptions) -> None:
    """The global aux loss's token counts summed over the stage's ranks that route
    different tokens (`routed_tokens_group`), as Megatron's `tp_dp_cp_group`."""
    group = routed_tokens_group(options.layout)
    for part in built.parts:
        for router in (m for m in part.modules() if isinstance(m, TopKRouter)):
            router.tp_dp_cp_group = group


def swap_in_transformer_engine(built: UnderConstruction, options: ConstructOptions) -> None:
    """Transformer Engine's modules in place of the TE spec's, the weights kept. After
    materializing (it copies weights) and the parallel splits (its modules are told the
    groups); before recompute, which must wrap TE's attention, not the one it replaced."""
    layout = options.layout
    parallel = TEParallelism(
        tp_group=layout.tp_mesh.get_group() if layout.tp > 1 else None,
        sequence_parallel=layout.sequence_parallel,
        cp_group=layout.cp_group if layout.cp > 1 else None,
    )
    for part in built.parts:
        apply_transformer_engine(part, options.fp8, config=built.model.config, parallel=parallel)


def recompute(built: UnderConstruction, options: ConstructOptions) -> None:
    """Activation recompute per part: the attention core (selective), runs of layers or
    the first layers (full), MoE layers. After every step that swaps the modules it
    checkpoints (context parallelism's ring, Transformer Engine); before compile."""
    r = options.recompute
    for part in built.parts:
        if r is not None and r.granularity == "selective":
            apply_recompute_modules(part, r.modules)
        elif r is not None:
            apply_activation_recompute(part, r.granularity, r.method, r.num_layers)
        if options.moe_layer_recompute:
            apply_moe_layer_recompute(part)


def compile_each_layer(built: UnderConstruction, options: ConstructOptions) -> None:
    """torch.compile of every layer. Last: it traces what every other step left."""
    compile_layers(nn.ModuleList(built.parts), options.device)


def shard_fully(built: UnderConstruction, options: ConstructOptions) -> None:
    """FSDP2 over the data × context ranks, one unit per layer (`mg.core.parallel.
    fully_sharded`). Last: it replaces the parameters the optimizer is then built over,
    and wraps whatever modules the other steps left."""
    layout = options.layout
    root = layout.tp_mesh._get_root_mesh()  # the mesh every parallel dim is cut from
    expert_mesh = None
    if layout.experts_apart:  # the experts' replicas: the expert data-parallel ranks
        expert_mesh = DeviceMesh.from_group(layout.expert_dp_group, root.device_type)
    apply_fully_shard(
        built.model,
        data_parallel_mesh(root, options.fully_sharded),
        options.fully_sharded,
        expert_mesh=expert_mesh,
    )
    if storage_waits_for_fsdp(built, options):  # this rank's shards only: no rank holds
        _give_storage(built, options)  # the whole model


def storage_waits_for_fsdp(built: UnderConstruction, options: ConstructOptions) -> bool:
    """A meta model under FSDP gets storage once sharded; with expert parallelism (which
    keeps a rank's experts by dropping the others' storage) before it, as without FSDP."""
    return built.on_meta and fully_sharded_here(options) and not options.layout.experts_apart


def fully_sharded_here(options: ConstructOptions) -> bool:
    """FSDP asked for, over more than one data × context rank (one rank: nothing to shard)."""
    return options.fully_sharded is not None and options.layout.dp * options.layout.cp > 1


@dataclass(frozen=True)
class Step:
    name: str
    applies: Callable[[ConstructOptions], bool]
    run: Callable[[UnderConstruction, ConstructOptions], None]


STEPS: tuple[Step, ...] = (
    Step("vocab mask", lambda o: o.real_vocab_size is not None, mask_padded_vocab),
    Step("cross-entropy fusion", lambda o: o.cross_entropy_fusion, fuse_cross_entropy),
    Step("FP8 linears (torchao)", lambda o: o.float8 is not None, float8_linears),
    Step("tensor parallel", lambda o: o.layout.tp > 1, shard_tensor_parallel),
    Step("context parallel", lambda o: o.layout.cp > 1, ring_attention),
    Step("pipeline split", lambda o: o.layout.pp > 1, split_pipeline),
    Step("materialize", lambda o: True, give_storage),
    Step("expert parallel", lambda o: o.layout.experts_apart, keep_own_experts),
    Step(
        "MoE aux-loss groups",
        lambda o: o.layout.world_size // o.layout.pp > 1,
        share_aux_loss_counts,
    ),
    Step("Transformer Engine", lambda o: o.transformer_engine, swap_in_transformer_engine),
    Step(
        "recompute",
        lambda o: o.recompute is not None or o.moe_layer_recompute,
        recompute,
    ),
    Step("compile", lambda o: o.compile, compile_each_layer),
    Step("fully sharded data parallel", fully_sharded_here, shard_fully),
)
"""The construction order, once (see the table in the module docstring)."""


def steps_named(*names: str) -> tuple[Step, ...]:
    """The entries of `STEPS` with these names, in `STEPS`' order: a tool's subset."""
    unknown = set(names) - {step.name for step in STEPS}
    if unknown:
        raise ValueError(f"no construction step named {sorted(unknown)}")
    return tuple(step for step in STEPS if step.name in names)


LOADING_STEPS = steps_named("tensor parallel", "pipeline split", "materialize")
"""Reading a checkpoint into a parallel layout (mg-eval, mg-serve, mg-quantize): the
model is sharded and split on the meta device, then given storage the checkpoint fills."""


def planned_steps(options: ConstructOptions, steps: tuple[Step, ...] = STEPS) -> list[str]:
    """The names of the steps `options` runs, in order."""
    return [step.name for step in steps if step.applies(options)]


def construct(
    model: nn.Module, options: ConstructOptions, steps: tuple[Step, ...] = STEPS
) -> nn.Module:
    """Run `steps` (default: all of `STEPS`, each where its option asks for it) on a
    family's plain model; returns the model, or a `PipelineModel` of this rank's chunks.

    A model built on the meta device gets storage in the materialize step, after the
    parallel splits, so each rank allocates only what it holds."""
    built = UnderConstruction(
        model, parts=[model], on_meta=any(p.is_meta for p in model.parameters())
    )
    for step in steps:
        if step.applies(options):
            step.run(built, options)
    return built.result(options.layout)


def routed_tokens_group(layout: ParallelLayout) -> torch.distributed.ProcessGroup | None:
    """The ranks of a pipeline stage that route different tokens, over which MoE token
    counts are summed (Megatron's tensor × data × context group): data × context ranks,
    and the tensor-parallel ones too when they route their own slices of the sequence
    (an expert-tensor-parallel size below TP; the etp ranks of an expert tensor-parallel
    group count their chunk alike, which scales every count by etp and leaves the
    balancing alike). Tensor-parallel ranks that route the same tokens (experts split
    over all of TP) are left out: they would count each token tp times."""
    return layout.stage_group or layout.dp_cp_group
