"""Megatron-LM's training flags, parsed once into typed dataclasses.

    args = parse_args(["gpt", "--num-layers", "2", ...])   # or --config run.yaml
    args.model.hidden_size, args.training.global_batch_size, args.optimizer.lr

Every flag keeps Megatron's name, so commands written for `pretrain_gpt.py`
work with `mg-train gpt`. A YAML file given with `--config` holds the same
flags as keys (`hidden_size` or `hidden-size`); flags on the command line win.
`validate` refuses inconsistent settings with Megatron-like messages before
anything heavy (datasets, models, process groups) is built.

One module per Megatron argument group, each with its flags, its dataclass and
its checks: `model`, `transformer_engine`, `moe`, `mamba`, `parallel`,
`training`, `learning_rate`, `data`, `logging`, `checkpointing`; `parser`
assembles them, and `checkpoint_args` fills the model from `--load` under
`--use-checkpoint-args`.
"""

from mg.trainer.arguments.args import GROUPS, Args
from mg.trainer.arguments.checkpointing import CheckpointArgs
from mg.trainer.arguments.data import DataArgs
from mg.trainer.arguments.errors import ArgumentError
from mg.trainer.arguments.learning_rate import OptimizerArgs
from mg.trainer.arguments.logging import LoggingArgs
from mg.trainer.arguments.mamba import MambaArgs
from mg.trainer.arguments.model import ModelArgs
from mg.trainer.arguments.moe import MoEArgs, moe_config_fields, parse_moe_layer_freq
from mg.trainer.arguments.parallel import DistributedArgs
from mg.trainer.arguments.parser import FAMILIES, build_parser, finalize, parse_args, validate
from mg.trainer.arguments.training import TrainingArgs
from mg.trainer.arguments.transformer_engine import TransformerEngineArgs

__all__ = [
    "FAMILIES",
    "GROUPS",
    "ArgumentError",
    "Args",
    "CheckpointArgs",
    "DataArgs",
    "DistributedArgs",
    "LoggingArgs",
    "MambaArgs",
    "MoEArgs",
    "ModelArgs",
    "OptimizerArgs",
    "TrainingArgs",
    "TransformerEngineArgs",
    "build_parser",
    "finalize",
    "moe_config_fields",
    "parse_args",
    "parse_moe_layer_freq",
    "validate",
]
