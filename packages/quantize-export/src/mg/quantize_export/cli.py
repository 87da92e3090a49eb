"""`mg-quantize`: post-training quantization of an mg checkpoint or a Hugging Face folder.

    mg-quantize --load ckpt --save ckpt-int8 --recipe int8_wo
    mg-quantize --load ckpt --save ckpt-gptq --recipe int4_gptq --group-size 128 \\
        --calib-data-path data/corpus_text_document --calib-samples 128 --calib-seq-length 512
    mg-quantize --load ckpt --save ckpt-q8 --recipe int8_wo --export-format gguf

The output is an mg checkpoint (loaded as is by mg-eval and mg-serve) plus, with
--export-format, a deployable copy inside it. torch is imported only after the
flags are checked, so --help and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

# the names of mg.core.quantization.config.RECIPES (a test keeps them equal; importing
# core here would import torch before --help)
RECIPES = {
    "int8_wo": "W8A16: int8 weights, one scale per output channel; no calibration.",
    "int4_wo": "W4A16: int4 weights in groups of --group-size inputs, round to nearest; "
    "no calibration.",
    "int4_awq": "int4 after AWQ's activation-aware scale search (scales folded into the "
    "preceding norm / gated fc1); needs --calib-data-path.",
    "int4_gptq": "int4 by GPTQ (Hessian-guided rounding, --gptq-damp, --act-order); "
    "needs --calib-data-path.",
    "int8_sq": "W8A8 SmoothQuant: smoothed int8 weights, int8 per-token dynamic "
    "activations (--smoothquant-alpha); needs --calib-data-path.",
    "fp8": "E4M3 weights (per tensor, or --fp8-per-channel) and E4M3 activations with a "
    "static scale from calibrated amax; needs --calib-data-path.",
}
INT4 = ("int4_wo", "int4_awq", "int4_gptq")
GROUP_SIZES = (32, 64, 128)
EXPORTS = ("hf", "gguf", "trtllm")
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q4_K_M", "Q5_K", "Q5_K_M", "Q6_K", "F16", "BF16")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2
        print(f"mg-quantize: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    recipes = "\n".join(f"  {name:10} {text}" for name, text in RECIPES.items())
    parser = _Parser(
        prog="mg-quantize",
        description="Post-training quantization of an mg checkpoint or a Hugging Face folder, "
        "and export to compressed-tensors (vLLM, transformers), GGUF (llama.cpp) or "
        "ModelOpt's unified layout (TensorRT-LLM).",
        epilog=f"recipes:\n{recipes}\n\nThe output layer and MoE routers stay in float.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = parser.add_argument_group("checkpoints")
    io.add_argument("--load", required=True, help="mg checkpoint folder or Hugging Face folder")
    io.add_argument("--save", required=True, help="output folder (written atomically)")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    q = parser.add_argument_group("quantization")
    q.add_argument("--recipe", required=True, help=f"one of {', '.join(RECIPES)}")
    q.add_argument("--group-size", type=int, default=128, help="int4: inputs per scale")
    q.add_argument("--asymmetric", action="store_true", help="int4: with zero points")
    q.add_argument("--gptq-damp", type=float, default=0.01, help="GPTQ percdamp")
    q.add_argument("--act-order", action="store_true", help="GPTQ: columns by diag(H)")
    q.add_argument(
        "--awq-clip", action="store_true",
        help="int4_awq: also search each group's clipping range (AutoAWQ's apply_clip)",
    )  # fmt: skip
    q.add_argument("--smoothquant-alpha", type=float, default=0.5, help="int8_sq: migration")
    q.add_argument("--fp8-per-channel", action="store_true", help="fp8: per-channel scales")
    q.add_argument(
        "--exclude", nargs="+", action="extend", default=[], metavar="PATTERN",
        help="glob patterns of linear names kept in float (decoder.layers.0.*)",
    )  # fmt: skip
    q.add_argument(
        "--quantize-output-layer", action="store_true",
        help="quantize the (untied) output layer too, as llama.cpp does; kept in float by "
        "default, as ModelOpt and llm-compressor keep lm_head",
    )  # fmt: skip
    c = parser.add_argument_group("calibration and evaluation data")
    c.add_argument("--calib-data-path", nargs="+", metavar="PREFIX", help="indexed dataset(s)")
    c.add_argument("--calib-samples", type=int, default=128)
    c.add_argument("--calib-seq-length", type=int, default=None, help="default: min(512, seq)")
    c.add_argument(
        "--eval-data-path", nargs="+", metavar="PREFIX",
        help="held-out data: perplexity and KL divergence before/after",
    )  # fmt: skip
    c.add_argument("--eval-samples", type=int, default=32)
    e = parser.add_argument_group("export and report")
    e.add_argument("--export-format", choices=EXPORTS, help="also write SAVE/<format>/")
    e.add_argument(
        "--gguf-type",
        choices=GGUF_TYPES,
        help="GGUF tensor type (default: from the recipe, Q8_0 or Q4_0/Q4_1); Q4_K_M and "
        "Q5_K_M are llama.cpp's mixes (attn_v and ffn_down in Q6_K in a third of the layers)",
    )
    e.add_argument("--report", type=Path, help="write the report as JSON here")
    e.add_argument("--no-progress", action="store_true")
    return parser


def check_args(args: argparse.Namespace) -> None:
    parser_error = lambda msg: _Parser().error(msg)  # noqa: E731
    if args.recipe not in RECIPES:
        parser_error(f"--recipe {args.recipe!r} is not known; choose one of {', '.join(RECIPES)}")
    if args.recipe in INT4 and args.group_size not in GROUP_SIZES:
        parser_error(f"--group-size {args.group_size}: int4 recipes take 32, 64 or 128")
    if args.asymmetric and args.recipe not in INT4:
        parser_error("--asymmetric applies to the int4 recipes only")
    if args.awq_clip and args.recipe != "int4_awq":
        parser_error("--awq-clip applies to --recipe int4_awq only")
    if not 0 <= args.gptq_damp < 1:
        parser_error("--gptq-damp is a fraction of mean(diag H) in [0, 1)")
    if not 0 <= args.smoothquant_alpha <= 1:
        parser_error("--smoothquant-alpha is in [0, 1]")
    if args.calib_samples < 1 or args.eval_samples < 1:
        parser_error("--calib-samples and --eval-samples must be >= 1")
    if args.gguf_type and args.export_format != "gguf":
        parser_error("--gguf-type needs --export-format gguf")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    from mg.core.checkpoint import CheckpointError
    from mg.quantize_export.errors import QuantizeInputError

    try:
        report = run(args)
    except (QuantizeInputError, CheckpointError) as exc:
        print(f"mg-quantize: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(format_report(report))


def run(args: argparse.Namespace) -> dict:
    import torch

    from mg.core.quantization import kernel_paths
    from mg.core.quantization.primitives import QuantizationError
    from mg.quantize_export.calibration import calibration_samples
    from mg.quantize_export.errors import QuantizeInputError
    from mg.quantize_export.evaluation import agreement, reference_log_probs, state_bytes
    from mg.quantize_export.loading import load_source
    from mg.quantize_export.output import (
        check_target,
        copy_tokenizer,
        save_quantized,
        staged_output,
    )
    from mg.quantize_export.recipes import CALIBRATED, RecipeOptions, quantize_model

    save = Path(args.save)
    check_target(save, args.overwrite)
    source = load_source(args.load)
    model, config = source.model, source.config
    if args.quantize_output_layer and getattr(model, "output_layer", None) is None:
        raise QuantizeInputError(
            "--quantize-output-layer: this model's output layer is its word embedding "
            "(tied weights); drop the flag, or quantize a model trained with "
            "--untie-embeddings-and-output-weights"
        )
    src_dtype = model.embedding.word_embeddings.weight.dtype
    model.float()
    vocab = _tokenizer_vocab(source.tokenizer_config, config.vocab_size)
    seq = args.calib_seq_length or min(512, config.seq_length)
    longest = config.max_position_embeddings or config.seq_length
    if seq > longest:
        raise QuantizeInputError(
            f"--calib-seq-length {seq} is longer than the model's {longest} positions"
        )
    samples = None
    if args.recipe in CALIBRATED and args.calib_data_path:
        samples = calibration_samples(args.calib_data_path, args.calib_samples, seq, vocab)
    eval_samples = None
    report: dict = {"load": str(args.load), "save": str(save), "recipe": args.recipe}
    if args.eval_data_path:
        eval_len = min(seq, config.seq_length - 1) + 1
        eval_samples = calibration_samples(args.eval_data_path, args.eval_samples, eval_len, vocab)
        reference = tempfile.TemporaryDirectory(prefix="mg-quantize-reference-")
        report["ppl_before"] = reference_log_probs(model, eval_samples, Path(reference.name))
    if args.export_format:
        from mg.core.quantization import QuantizationConfig
        from mg.quantize_export.exports import check_export

        planned = QuantizationConfig(
            args.recipe, symmetric=not args.asymmetric, fp8_per_channel=args.fp8_per_channel
        )
        check_export(args.export_format, config, planned)
    size_before = _float_bytes(model, src_dtype)
    options = RecipeOptions(
        recipe=args.recipe,
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        gptq_damp=args.gptq_damp,
        act_order=args.act_order,
        awq_clip=args.awq_clip,
        sq_alpha=args.smoothquant_alpha,
        fp8_per_channel=args.fp8_per_channel,
        exclude=list(args.exclude),
        quantize_output_layer=args.quantize_output_layer,
        progress=not args.no_progress,
    )
    try:
        result = quantize_model(model, options, samples)
    except QuantizationError as exc:
        raise QuantizeInputError(str(exc)) from None
    if eval_samples is not None:
        moved = agreement(model, eval_samples, Path(reference.name))
        reference.cleanup()
        report["ppl_after"] = moved.perplexity
        report["ppl_change_pct"] = 100 * (report["ppl_after"] / report["ppl_before"] - 1)
        report["kl_divergence"] = moved.kl_divergence
        report["kl_divergence_p99"] = moved.kl_divergence_p99
        report["same_top_token_pct"] = 100 * moved.same_top_token
    with torch.no_grad():  # float parts back to the source's dtype (scales stay fp32)
        for p in model.parameters():
            p.data = p.data.to(src_dtype)
    report.update(
        size_before_bytes=size_before,
        size_after_bytes=state_bytes(model),
        quantized_linears=len(result.config.modules),
        weight_error=result.weight_error,
        kernels=[f"{kind}: {path}" for kind, path in kernel_paths()],
    )
    with staged_output(save, args.overwrite) as folder:
        tokenizer_config = copy_tokenizer(source.tokenizer_config, folder)
        save_quantized(folder, model, config, tokenizer_config, result.config, vars_of(args))
        if args.export_format:
            from mg.quantize_export.exports import export

            report["export"] = export(
                args.export_format, folder, model, config, tokenizer_config, result.config,
                args.gguf_type,
            )  # fmt: skip
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(report, indent=2) + "\n")
    return report


def vars_of(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def _float_bytes(model, dtype) -> int:
    return sum(t.numel() * dtype.itemsize for t in model.state_dict().values())


def _tokenizer_vocab(tokenizer_config, model_vocab: int) -> int:
    """The tokenizer's vocabulary (ids past it are another tokenizer's), else the model's."""
    if tokenizer_config is None:
        return model_vocab
    try:
        from mg.core.tokenizers import build_tokenizer

        return min(build_tokenizer(tokenizer_config).vocab_size, model_vocab)
    except Exception:  # an unbuildable tokenizer is mg-eval's problem, not calibration's
        return model_vocab


def format_report(report: dict) -> str:
    mb = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    lines = [
        f"recipe {report['recipe']}: {report['quantized_linears']} linears quantized",
        f"size: {mb(report['size_before_bytes'])} -> {mb(report['size_after_bytes'])} "
        f"({report['size_after_bytes'] / report['size_before_bytes']:.2f}x)",
    ]
    if "ppl_before" in report:
        lines.append(
            f"perplexity: {report['ppl_before']:.4f} -> {report['ppl_after']:.4f} "
            f"({report['ppl_change_pct']:+.3f}%)"
        )
        lines.append(
            f"KL divergence from the float model: mean {report['kl_divergence']:.6f}, "
            f"p99 {report['kl_divergence_p99']:.6f} nats; same top token "
            f"{report['same_top_token_pct']:.2f}%"
        )
    lines.append("relative weight error per layer:")
    lines += [f"  {name}: {err:.5f}" for name, err in report["weight_error"].items()]
    lines += [f"kernel: {k}" for k in report.get("kernels", [])]
    if "export" in report:
        lines.append(f"export: {report['export']}")
    lines.append(f"saved {report['save']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
