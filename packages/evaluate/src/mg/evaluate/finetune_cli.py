"""`mg-eval race|mnli|qqp`: Megatron's ``tasks/main.py`` finetune recipes as subcommands.

Flag names are Megatron's (``--pretrained-checkpoint``, ``--train-data``,
``--valid-data``, ``--epochs``, ``--lr``, ...); the defaults are those of its
example scripts (``examples/*/finetune_race.sh``, ``finetune_mnli_distributed.sh``)
except ``--seq-length``, which defaults to the checkpoint's.
"""

from __future__ import annotations

import argparse
from typing import Any

from mg.core.cli_types import ckpt_step
from mg.core.help_format import DefaultsHelpFormatter
from mg.evaluate.errors import EvalInputError
from mg.evaluate.parallel_flags import add_model_parallel_flags, check_bert_task_layout

# task: (help, defaults of the Megatron recipe)
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "race": (
        "finetune a BERT on RACE (4-way multiple choice) and report accuracy",
        dict(epochs=3, lr=1e-5, lr_warmup_fraction=0.06, micro_batch_size=4, weight_decay=0.1),
    ),
    "mnli": (
        "finetune a BERT on GLUE MNLI (3-way classification) and report accuracy",
        dict(epochs=5, lr=5e-5, lr_warmup_fraction=0.065, micro_batch_size=8, weight_decay=0.1),
    ),
    "qqp": (
        "finetune a BERT on GLUE QQP (duplicate questions, 2-way) and report accuracy",
        dict(epochs=5, lr=5e-5, lr_warmup_fraction=0.065, micro_batch_size=8, weight_decay=0.1),
    ),
}
_DATA_HELP = {
    "race": "RACE folder(s) of *.txt JSON files (e.g. RACE/train/middle RACE/train/high)",
    "mnli": "GLUE MNLI .tsv file(s) (train.tsv; dev_matched.tsv dev_mismatched.tsv)",
    "qqp": "GLUE QQP .tsv file(s) (train.tsv; dev.tsv)",
}


def add_finetune_tasks(sub: argparse._SubParsersAction) -> None:
    for task, (help_text, recipe) in RECIPES.items():
        p = sub.add_parser(
            task,
            help=help_text,
            description=help_text.capitalize() + ", as Megatron-LM's tasks/main.py does. "
            "Defaults are Megatron's example recipe for the task.",
            formatter_class=DefaultsHelpFormatter,
        )
        g = p.add_argument_group("model and data")
        g.add_argument(
            "--pretrained-checkpoint",
            required=True,
            metavar="DIR",
            help="BERT checkpoint (mg-train bert --save, or mg-convert import-hf of a BERT)",
        )
        g.add_argument(
            "--ckpt-step", type=ckpt_step, default=None, metavar="N", help="iteration to load"
        )
        g.add_argument("--train-data", nargs="+", required=True, help=_DATA_HELP[task])
        g.add_argument("--valid-data", nargs="+", required=True, help=_DATA_HELP[task])
        g.add_argument(
            "--seq-length", type=int, default=None, help="default: the checkpoint's seq_length"
        )
        g.add_argument("--micro-batch-size", type=int, default=recipe["micro_batch_size"])
        o = p.add_argument_group("optimization")
        o.add_argument("--epochs", type=int, default=recipe["epochs"])
        o.add_argument("--lr", type=float, default=recipe["lr"])
        o.add_argument("--min-lr", type=float, default=0.0)
        o.add_argument(
            "--lr-decay-style", choices=("linear", "cosine", "constant"), default="linear"
        )
        o.add_argument("--lr-warmup-fraction", type=float, default=recipe["lr_warmup_fraction"])
        o.add_argument("--weight-decay", type=float, default=recipe["weight_decay"])
        o.add_argument("--clip-grad", type=float, default=1.0)
        o.add_argument("--adam-beta1", type=float, default=0.9)
        o.add_argument("--adam-beta2", type=float, default=0.999)
        o.add_argument("--adam-eps", type=float, default=1e-8)
        o.add_argument(
            "--hidden-dropout", type=float, default=None, help="default: the checkpoint's"
        )
        o.add_argument(
            "--attention-dropout", type=float, default=None, help="default: the checkpoint's"
        )
        o.add_argument("--seed", type=int, default=1234)
        o.add_argument("--log-interval", type=int, default=100)
        o.add_argument(
            "--eval-interval",
            type=int,
            default=None,
            help="also evaluate every N iterations (always after each epoch)",
        )
        p.add_argument("--report", metavar="FILE.jsonl", help="append the results as a JSON line")
        add_model_parallel_flags(p, bert_task=True)
        t = p.add_argument_group("tokenizer", "override the checkpoint's tokenizer")
        t.add_argument("--tokenizer-type")
        t.add_argument("--vocab-file")
        t.add_argument("--merge-file")
        t.add_argument("--tokenizer-model")
        p.set_defaults(run=run_finetune_task)


def _check(args: argparse.Namespace) -> None:
    check_bert_task_layout(
        args.task, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    )
    for flag in ("epochs", "micro_batch_size", "log_interval"):
        if getattr(args, flag) < 1:
            raise EvalInputError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise EvalInputError("--lr must be > 0 and 0 <= --min-lr <= --lr")
    if not 0.0 <= args.lr_warmup_fraction < 1.0:
        raise EvalInputError("--lr-warmup-fraction must be in [0, 1)")
    if args.eval_interval is not None and args.eval_interval < 1:
        raise EvalInputError("--eval-interval must be >= 1")
    for flag in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, flag)
        if value is not None and not 0.0 <= value < 1.0:
            raise EvalInputError(f"--{flag.replace('_', '-')} must be in [0, 1)")


def run_finetune_task(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    # lazy: torch and the model code only once the flags are parsed (--help stays instant)
    import torch

    # lazy, as torch: each of these imports it
    from mg.evaluate import distributed
    from mg.evaluate.classification import BertClassifier
    from mg.evaluate.finetune import FinetuneConfig, finetune
    from mg.evaluate.glue import MNLI, QQP, glue_samples
    from mg.evaluate.model_loading import TOKENIZER_FIELDS, load_bert_for_finetune
    from mg.evaluate.race import NUM_CHOICES, race_samples

    _check(args)
    loaded = load_bert_for_finetune(
        args.pretrained_checkpoint,
        args.ckpt_step,
        {name: getattr(args, name) for name in TOKENIZER_FIELDS},
        {"hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout},
    )
    config = loaded.config
    seq_length = args.seq_length or config.seq_length
    if not 3 <= seq_length <= config.max_position_embeddings:
        raise EvalInputError(
            f"--seq-length {seq_length} must be between 3 and the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    if args.task == "race":
        build = lambda paths: race_samples(paths, loaded.tokenizer, seq_length)  # noqa: E731
    else:
        task = MNLI if args.task == "mnli" else QQP
        build = lambda paths: glue_samples(task, paths, loaded.tokenizer, seq_length)  # noqa: E731
    train = build(args.train_data)
    valid = {path: build([path]) for path in args.valid_data}
    torch.manual_seed(args.seed)
    if args.task == "race":
        model = BertClassifier(loaded.model, num_classes=1, num_choices=NUM_CHOICES)
    else:
        model = BertClassifier(loaded.model, num_classes=task.num_classes)
    dp_group = _shard_over_tensor_parallel(model, args.tensor_model_parallel_size, args.seed)
    fields = FinetuneConfig.__dataclass_fields__
    ft_config = FinetuneConfig(**{k: getattr(args, k) for k in fields})
    log = print if distributed.is_main() else (lambda _line: None)
    trimmed = sum(s.trimmed for s in train)
    if trimmed:
        log(f" > {trimmed} of {len(train)} training examples cut to --seq-length {seq_length}")
    result = finetune(model, train, valid, ft_config, log, dp_group=dp_group)
    correct = sum(a.correct for a in result.accuracy.values())
    total = sum(a.total for a in result.accuracy.values())
    metrics = dict(
        num_correct=correct,
        num_examples=total,
        accuracy=correct / total,
        per_dataset={
            name: dict(correct=a.correct, total=a.total, accuracy=a.correct / a.total)
            for name, a in result.accuracy.items()
        },
        final_train_loss=result.final_loss,
        iterations=result.iterations,
    )
    context = dict(
        train_data=args.train_data,
        valid_data=args.valid_data,
        seq_length=seq_length,
        epochs=args.epochs,
        lr=args.lr,
        micro_batch_size=args.micro_batch_size,
        history=result.history,
    )
    return metrics, dict(context, iteration=loaded.iteration)


def _shard_over_tensor_parallel(model: Any, tp: int, seed: int) -> Any:
    """With --tensor-model-parallel-size > 1: split the classifier's BERT over the TP ranks
    (every rank loaded the whole checkpoint and keeps its shards; the pooler and the head
    stay replicated, as Megatron's classification head). Returns the data-parallel group
    (None: the whole world is data parallel)."""
    if tp == 1:
        return None
    # lazy: torch only once the flags are parsed (`mg-eval --help` builds this parser)
    from mg.core.parallel.tensor_parallel import TensorParallelError, apply_tensor_parallel
    from mg.evaluate.model_parallel import build_eval_layout

    layout = build_eval_layout(tp, 1, model.head.weight.device.type)
    try:
        apply_tensor_parallel(
            model.bert,
            layout.tp_mesh,
            sequence_parallel=False,
            seed=layout.tensor_parallel_seed(seed),
        )
    except TensorParallelError as err:
        raise EvalInputError(str(err)) from None
    return layout.dp_group
