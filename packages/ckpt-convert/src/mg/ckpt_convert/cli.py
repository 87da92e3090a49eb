"""`mg-convert`: move models between Hugging Face, Megatron-LM and mg checkpoints.

Each subcommand is one module; this file only parses flags and turns user
errors into one line, `mg-convert <cmd>: error: ...`, with exit status 2.
It imports no torch until the flags are parsed, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.output_folder import check_save, replacing
from mg.core.cli_types import ckpt_step
from mg.core.io_paths import output_clash

EPILOG = """examples:
  mg-convert import-hf ./Llama-3.2-1B --save ckpt/llama
  mg-convert import-gguf SmolLM2-135M-Instruct.Q4_1.gguf --save ckpt/smollm2
  mg-convert export-hf --load ckpt/llama --save ./llama-hf --shard-size 2GB
  mg-convert inspect ckpt/llama
  mg-convert import-megatron --load megatron_ckpt --save ckpt/from-megatron
  mg-convert export-megatron --load ckpt/llama --save megatron_ckpt \\
      --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
  mg-convert export-megatron --load ckpt/llama --save megatron_dist --ckpt-format torch_dist
  mg-convert import-megatron --load megatron_moe --save ckpt/moe --target-expert-parallel-size 1
  mg-convert export-megatron --load ckpt/moe --save megatron_moe_ep4 \
      --target-expert-parallel-size 4 --expert-layout sequential
  mg-convert reshard --load ckpt/llama --save ckpt/llama-tp2pp2 \\
      --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
  mg-convert format --to torch_dist --load ckpt/llama-tp2pp2 --save ckpt/llama-dist
  mg-convert combine-vlm --input ckpt/mistral ckpt/clip \
      --prefixes language_model vision_model --save ckpt/mistral-clip
"""


def _ckpt_step_flag(p: argparse.ArgumentParser) -> None:
    """Megatron's --ckpt-step picks the saved iteration; --iteration is kept as an alias."""
    p.add_argument(
        "--ckpt-step",
        "--iteration",
        dest="iteration",
        type=ckpt_step,
        default=None,
        metavar="N",
        help="the saved iteration to read, an int or 'release' (Megatron's --ckpt-step; "
        "--iteration is an alias); default: latest_checkpointed_iteration.txt",
    )


def _overwrite_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --save (an earlier output): the new one is written beside "
        "it and swapped in only when complete; without it an existing --save is refused",
    )


def _import_hf(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.finite_check import warn_if_nonfinite
    from mg.ckpt_convert.import_hf import import_hf

    path = import_hf(args.src, args.save, args.dtype, args.make_vocab_size_divisible_by)
    warn_if_nonfinite(path, args.src)


def _import_gguf(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch and gguf; --help stays instant
    from mg.ckpt_convert.finite_check import warn_if_nonfinite
    from mg.ckpt_convert.import_gguf import import_gguf

    path = import_gguf(args.src, args.save, args.dtype, args.make_vocab_size_divisible_by)
    warn_if_nonfinite(path, args.src)


def _export_hf(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.export_hf import export_hf

    export_hf(args.load, args.save, args.shard_size, args.iteration)


def _combine_vlm(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.combine_vlm import combine_vlm

    combine_vlm(args.input, args.prefixes, args.save)


def _inspect(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.inspect_checkpoint import format_summary, summarize

    summary = summarize(args.dir, args.iteration)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))


def _megatron(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.megatron_lm import export_megatron, import_megatron

    convert = import_megatron if args.command == "import-megatron" else export_megatron
    extra = {"ckpt_format": args.ckpt_format} if args.command == "export-megatron" else {}
    convert(
        args.load,
        args.save,
        args.iteration,
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.make_vocab_size_divisible_by,
        ep=args.target_expert_parallel_size,
        expert_layout=args.expert_layout,
        **extra,
    )


def _layout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="source checkpoint folder")
    p.add_argument("--save", required=True, help="new checkpoint folder (see --overwrite)")
    _overwrite_flag(p)
    # Megatron's convert.py spells them --target-*-parallel-size; its training flags say
    # *-model-parallel-size: both spellings are accepted.
    p.add_argument(
        "--target-tensor-parallel-size",
        "--target-tensor-model-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="default: keep",
    )
    p.add_argument(
        "--target-pipeline-parallel-size",
        "--target-pipeline-model-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="default: keep",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=None,
        help="when the padded vocabulary does not split into the target TP, re-pad it to a "
        "multiple of this × TP (default: the checkpoint's args, else 128)",
    )
    _ckpt_step_flag(p)


def _expert_flags(p: argparse.ArgumentParser, layout: bool) -> None:
    """An MoE's expert-parallel size (Megatron's mp_rank_TT[_PPP]_EEE files) and layout."""
    p.add_argument(
        "--target-expert-parallel-size",
        "--target-expert-model-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="MoE: expert-parallel ranks, each holding num_experts/N experts (default: keep)",
    )
    if layout:
        p.add_argument(
            "--expert-layout",
            choices=("sequential", "grouped"),
            default=None,
            help="MoE: the routed experts as SequentialMLP (local_experts.N.linear_fc1.weight) "
            "or grouped GEMM (linear_fc1.weightN). import default: the checkpoint's; export "
            "default: grouped for a model with Transformer Engine names that uses it, else "
            "sequential (Megatron-LM's local spec loads only that)",
        )


def _reshard(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.reshard import reshard

    reshard(
        args.load,
        args.save,
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.iteration,
        args.make_vocab_size_divisible_by,
        ep=args.target_expert_parallel_size,
    )


def _format(args: argparse.Namespace) -> None:
    # lazy: the subcommand's module imports torch; --help stays instant
    from mg.ckpt_convert.format_convert import convert_format

    convert_format(
        args.load,
        args.save,
        args.to,
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.iteration,
        args.make_vocab_size_divisible_by,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mg-convert",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "import-hf",
        help="Hugging Face GPT-2/Llama/Mistral folder or repo id → mg checkpoint",
        description="Convert a Hugging Face model (config.json + safetensors or "
        "pytorch_model.bin, sharded or not) into an mg `torch` checkpoint (iteration "
        "'release'), layer by layer. Tokenizer files are copied to SAVE/tokenizer/. "
        "SRC may be a Hub repo id: it is taken from the local cache (HF_HUB_OFFLINE=1 "
        "never touches the network).",
    )
    p.add_argument("src", metavar="SRC", help="local folder or Hugging Face repo id")
    p.add_argument("--save", required=True, help="new checkpoint folder (see --overwrite)")
    _overwrite_flag(p)
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="cast the weights (default: keep the stored dtype, so export is bit-exact)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the embedding rows to a multiple of this, as Megatron does (default 128); "
        "export slices them off again",
    )
    p.set_defaults(run=_import_hf)

    p = sub.add_parser(
        "import-gguf",
        help="llama.cpp GGUF file (Llama/Mistral/Qwen2/Qwen3) → mg checkpoint",
        description="Convert a GGUF file into an mg `torch` checkpoint (iteration 'release'): "
        "weights dequantized (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K), llama.cpp's q/k row "
        "permutation undone, the vocabulary, special tokens and chat template written as "
        "SAVE/tokenizer/tokenizer.json.",
    )
    p.add_argument("src", metavar="GGUF_FILE", help="the .gguf file")
    p.add_argument("--save", required=True, help="new checkpoint folder (see --overwrite)")
    _overwrite_flag(p)
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of the stored weights (default fp32: every dequantized value exactly)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the embedding rows to a multiple of this, as Megatron does (default 128)",
    )
    p.set_defaults(run=_import_gguf)

    p = sub.add_parser(
        "export-hf",
        help="mg checkpoint → Hugging Face folder transformers loads",
        description="Write config.json, model.safetensors (or shards + index), "
        "generation_config.json and the tokenizer files. The architecture is the one "
        "recorded at import, else gpt2 for learned positions, mistral with a sliding "
        "window, llama otherwise.",
    )
    p.add_argument("--load", required=True, help="mg checkpoint folder")
    p.add_argument("--save", required=True, help="new Hugging Face folder (see --overwrite)")
    _overwrite_flag(p)
    p.add_argument("--shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    _ckpt_step_flag(p)
    p.set_defaults(run=_export_hf)

    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's config, iteration, layout, parameters, dtype, size",
        description="Summarise a `torch` or `torch_dist` checkpoint without loading its tensors.",
    )
    p.add_argument("dir", metavar="DIR", help="checkpoint folder")
    _ckpt_step_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_inspect)

    for name, direction in (
        ("import-megatron", "Megatron-LM GPT checkpoint (torch or torch_dist) → mg checkpoint"),
        ("export-megatron", "mg checkpoint → Megatron-LM GPT checkpoint (torch or torch_dist)"),
    ):
        p = sub.add_parser(
            name,
            help=direction,
            description=direction + ". Any tensor-, pipeline- and expert-parallel layout "
            "(mp_rank_TT[_PPP][_EEE], or torch_dist in Megatron-Core's sharded keys) in, the "
            "--target-* layout out (default: the source's); MoE models (--num-experts) with "
            "their moe_* args. Optimizer and RNG state are not carried over. Megatron-LM's "
            "args Namespace is read with pickle, so only load checkpoints you trust.",
        )
        _layout_flags(p)
        _expert_flags(p, layout=True)
        if name == "export-megatron":
            p.add_argument(
                "--ckpt-format",
                choices=("torch", "torch_dist"),
                default="torch",
                help="torch: mp_rank_TT[_PPP] files (default); torch_dist: Megatron-Core's "
                "dist checkpoint, which Megatron-LM loads at any TP/PP",
            )
        p.set_defaults(run=_megatron)

    p = sub.add_parser(
        "combine-vlm",
        help="a converted language model + vision tower → one VLM checkpoint",
        description="Megatron's combine_state_dicts.py: each --input's weights renamed "
        "<prefix>.<name> and written as one torch_dist checkpoint (iteration 1) for "
        "`mg-train vlm --pretrained-checkpoint`; without a vision_projection input, train "
        "with --allow-missing-vision-projection-checkpoint.",
    )
    p.add_argument(
        "--input", nargs="+", required=True, metavar="DIR", help="mg checkpoints (one rank)"
    )
    p.add_argument(
        "--prefixes",
        nargs="+",
        required=True,
        metavar="PREFIX",
        help="one per --input: language_model, vision_model, vision_projection",
    )
    p.add_argument("--save", required=True, help="output folder")
    _overwrite_flag(p)
    p.set_defaults(run=_combine_vlm)

    p = sub.add_parser(
        "reshard",
        help="`torch` checkpoint → the same model in another TP × PP layout",
        description="Rewrite a `torch`-format checkpoint (or a Megatron-LM `torch_dist` "
        "one) as a `torch` checkpoint for another tensor- and pipeline-parallel size "
        "(Megatron's convert.py --target-*-parallel-size), one pipeline stage at a time. "
        "Keeps iteration, args, model and tokenizer configs; drops optimizer and RNG state "
        "(their layout depends on the parallel layout). An MoE checkpoint's expert-parallel "
        "files (mp_rank_TT[_PPP]_EEE) are read and written too.",
    )
    _layout_flags(p)
    _expert_flags(p, layout=False)
    p.set_defaults(run=_reshard)

    p = sub.add_parser(
        "format",
        help="`torch` ↔ `torch_dist` checkpoint format",
        description="Convert between the `torch` format (mp_rank_TT[_PPP] files) and "
        "`torch_dist` (torch.distributed.checkpoint, loads into any layout). The source "
        "may have any layout; --target-* sizes default to the source's.",
    )
    p.add_argument("--to", required=True, choices=("torch", "torch_dist"), help="target format")
    _layout_flags(p)
    p.set_defaults(run=_format)
    return parser


def _fail(command: str, message: str) -> None:
    print(f"mg-convert {command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _hint(exc: BaseException, args: argparse.Namespace) -> str:
    """The error text, pointing only to flags this subcommand has: --ckpt-step where it
    reads a saved iteration; a Hugging Face source has no iterations to pick from."""
    text = str(exc).rstrip()
    if not hasattr(args, "iteration"):
        return text.replace(", or load another iteration.", ".")
    text = text.replace("pass iteration=N to load one of them", "pick one with --ckpt-step N")
    text = text.replace("or pass an explicit iteration.", "or pass --ckpt-step N.")
    if text.endswith("load another iteration."):
        text = text[:-1] + " (--ckpt-step N)."
    return text


def _own_input(args: argparse.Namespace) -> str | None:
    """A --save that is, holds or lies inside the input, in one line (None when apart)."""
    if args.command == "import-hf":  # SRC may be a Hub repo id, not a path
        source = ("SRC", args.src if os.path.exists(args.src) else None)
    elif args.command == "import-gguf":
        source = ("GGUF_FILE", args.src)
    elif args.command == "combine-vlm":
        return output_clash([("--save", args.save)], [("--input", i) for i in args.input])
    else:
        source = ("--load", getattr(args, "load", None))
    return output_clash([("--save", getattr(args, "save", None))], [source])


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    clash = _own_input(args)
    if clash:
        _fail(args.command, clash)
    save = getattr(args, "save", None)
    if save is not None:  # before anything is read: an output in the way fails at once
        try:
            check_save(save, args.overwrite)
        except ConvertError as exc:
            _fail(args.command, str(exc))
    # lazy: torch only once the flags are good, so --help stays instant
    from mg.core.checkpoint import CheckpointError
    from mg.core.models import ConfigError

    try:
        if save is None:
            args.run(args)
        else:
            with replacing(save, args.overwrite) as target:
                args.save = str(target)
                args.run(args)
            print(f"wrote {save}")
    except (ConvertError, CheckpointError, ConfigError) as exc:
        _fail(args.command, _hint(exc, args))
    except BrokenPipeError:
        # `mg-convert inspect DIR | head`: the reader left; stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()
