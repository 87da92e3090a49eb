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
import sys
from pathlib import Path
from typing import NoReturn

from mg.core.io_paths import output_clash, relation
from mg.quantize_export.errors import QuantizeInputError

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
    io.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing --save once the new output is complete (never a folder "
        "that is, holds or lies inside an input; mg-train's counterpart is "
        "--overwrite-checkpoints)",
    )  # fmt: skip
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
    e.add_argument(
        "--report", type=Path,
        help="write the report as JSON here (a path inside --save goes into the output)",
    )  # fmt: skip
    e.add_argument(
        "--no-progress-bar", "--no-progress", dest="no_progress", action="store_true",
        help="no progress bar, as mg-prep's flag (--no-progress is an alias)",
    )  # fmt: skip
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
    clash = output_clash([("--save", args.save), ("--report", args.report)], _inputs(args))
    if clash:
        parser_error(clash)
    if args.report and relation(args.report, args.save) in ("is", "contains"):
        parser_error(f"--report {args.report} is --save's folder or holds it; name a file")


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """What the run reads: the checkpoint and each dataset's .bin/.idx pair."""
    inputs = [("--load", args.load)]
    for flag, prefixes in (
        ("--calib-data-path", args.calib_data_path),
        ("--eval-data-path", args.eval_data_path),
    ):
        inputs += [
            (flag, prefix + suffix) for prefix in prefixes or () for suffix in (".bin", ".idx")
        ]
    return inputs


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    # lazy: torch only once the flags are checked, so --help answers at once
    from mg.core.checkpoint import CheckpointError
    from mg.quantize_export.pipeline import run

    try:
        report = run(args)
    except (QuantizeInputError, CheckpointError) as exc:
        print(f"mg-quantize: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(format_report(report))


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
