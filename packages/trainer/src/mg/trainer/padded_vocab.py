"""The embedding-table size a run's flags give, before any model is built.

Megatron pads the tokenizer's vocabulary to a multiple of
`--make-vocab-size-divisible-by` x `--tensor-model-parallel-size`
(`_vocab_size_with_padding`). The tokenizer is the checkpoint's under
`--use-checkpoint-args`, else the one the tokenizer flags describe. The
dry-run reports and the save guard's size estimate share this one answer.
"""

from __future__ import annotations

from mg.core.tokenizers import TokenizerConfig, build_tokenizer, vocab_size_with_padding
from mg.trainer.arguments import Args


def tokenizer_config(args: Args) -> TokenizerConfig:
    """The run's tokenizer: the checkpoint's under `--use-checkpoint-args`, else the one the
    tokenizer flags describe."""
    d = args.data
    return args.checkpoint_tokenizer_config or TokenizerConfig(
        tokenizer_type=d.tokenizer_type,
        vocab_file=d.vocab_file,
        merge_file=d.merge_file,
        tokenizer_model=d.tokenizer_model,
        vocab_size=d.vocab_size,
        vocab_extra_ids=d.vocab_extra_ids,
        tiktoken_pattern=d.tiktoken_pattern,
    )


def pad_vocab(args: Args, vocab_size: int) -> int:
    """`vocab_size` padded as Megatron pads it for this run's flags."""
    return vocab_size_with_padding(
        vocab_size,
        args.model.make_vocab_size_divisible_by,
        args.distributed.tensor_model_parallel_size,
    )


def padded_vocab_size(args: Args) -> int:
    """The padded vocabulary size of `args`' tokenizer (builds the tokenizer, no model)."""
    return pad_vocab(args, build_tokenizer(tokenizer_config(args)).vocab_size)
