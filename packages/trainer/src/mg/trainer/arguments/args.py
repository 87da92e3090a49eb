"""`Args`: every flag group of one `mg-train` run, each its own dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mg.trainer.arguments.checkpointing import CheckpointArgs
from mg.trainer.arguments.data import DataArgs
from mg.trainer.arguments.fsdp import FullyShardedArgs
from mg.trainer.arguments.gpt_oss import GptOssArgs
from mg.trainer.arguments.ict import ICTArgs
from mg.trainer.arguments.layer_variants import LayerVariantArgs
from mg.trainer.arguments.learning_rate import OptimizerArgs
from mg.trainer.arguments.logging import LoggingArgs
from mg.trainer.arguments.mamba import MambaArgs
from mg.trainer.arguments.mla import MLAArgs
from mg.trainer.arguments.model import ModelArgs
from mg.trainer.arguments.moe import MoEArgs
from mg.trainer.arguments.mtp import MTPArgs
from mg.trainer.arguments.parallel import DistributedArgs
from mg.trainer.arguments.retro import RetroArgs
from mg.trainer.arguments.sft import SFTArgs
from mg.trainer.arguments.training import TrainingArgs
from mg.trainer.arguments.transformer_engine import TransformerEngineArgs
from mg.trainer.arguments.vlm import VLMArgs


@dataclass
class Args:
    """Everything `mg-train` was asked to do, grouped by concern."""

    family: str
    model: ModelArgs = field(default_factory=ModelArgs)
    layer_variants: LayerVariantArgs = field(default_factory=LayerVariantArgs)
    gpt_oss: GptOssArgs = field(default_factory=GptOssArgs)
    mla: MLAArgs = field(default_factory=MLAArgs)
    transformer_engine: TransformerEngineArgs = field(default_factory=TransformerEngineArgs)
    data: DataArgs = field(default_factory=DataArgs)
    sft: SFTArgs = field(default_factory=SFTArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    fsdp: FullyShardedArgs = field(default_factory=FullyShardedArgs)
    mamba: MambaArgs = field(default_factory=MambaArgs)
    moe: MoEArgs = field(default_factory=MoEArgs)
    mtp: MTPArgs = field(default_factory=MTPArgs)
    retro: RetroArgs = field(default_factory=RetroArgs)
    vlm: VLMArgs = field(default_factory=VLMArgs)
    ict: ICTArgs = field(default_factory=ICTArgs)
    # Set by --use-checkpoint-args (mg.trainer.arguments.checkpoint_args), not by flags.
    checkpoint_model_config: dict[str, Any] | None = None
    checkpoint_tokenizer_config: Any = None

    @property
    def data_parallel_size(self) -> int:
        d = self.distributed
        model_parallel = (
            d.tensor_model_parallel_size * d.pipeline_model_parallel_size * d.context_parallel_size
        )
        return max(d.world_size // model_parallel, 1)

    def flat(self) -> dict[str, Any]:
        """All fields as one flat dict with Megatron's names (what a checkpoint's `args` holds)."""
        out: dict[str, Any] = {"model_family": self.family}
        for group in GROUPS:
            out.update(dataclasses.asdict(getattr(self, group)))
        out["data_parallel_size"] = self.data_parallel_size
        return out


# Attribute of `Args` -> the dataclass its flags fill.
GROUPS: dict[str, type] = {
    "model": ModelArgs,
    "layer_variants": LayerVariantArgs,
    "gpt_oss": GptOssArgs,
    "mla": MLAArgs,
    "transformer_engine": TransformerEngineArgs,
    "data": DataArgs,
    "sft": SFTArgs,
    "training": TrainingArgs,
    "optimizer": OptimizerArgs,
    "checkpoint": CheckpointArgs,
    "logging": LoggingArgs,
    "distributed": DistributedArgs,
    "fsdp": FullyShardedArgs,
    "mamba": MambaArgs,
    "moe": MoEArgs,
    "mtp": MTPArgs,
    "retro": RetroArgs,
    "vlm": VLMArgs,
    "ict": ICTArgs,
}
