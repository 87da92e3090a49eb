"""What `mg-quantize` does once its flags are checked: load the model, calibrate,
quantize, measure the change on held-out data, save the quantized checkpoint and,
with --export-format, a deployable copy inside it; the report of it all."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from mg.core.quantization import QuantizationConfig, kernel_paths
from mg.core.quantization.primitives import QuantizationError
from mg.core.tokenizers import build_tokenizer
from mg.quantize_export.calibration import calibration_samples
from mg.quantize_export.errors import QuantizeInputError
from mg.quantize_export.evaluation import agreement, reference_log_probs, state_bytes
from mg.quantize_export.exports import check_export, export
from mg.quantize_export.loading import load_source
from mg.quantize_export.output import (
    check_target,
    copy_tokenizer,
    save_quantized,
    staged_output,
    staged_path,
)
from mg.quantize_export.recipes import CALIBRATED, RecipeOptions, quantize_model


def run(args: argparse.Namespace) -> dict:
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
    if args.export_format:  # before any calibration or quantization work
        planned = QuantizationConfig(
            args.recipe, symmetric=not args.asymmetric, fp8_per_channel=args.fp8_per_channel
        )
        check_export(args.export_format, model, config, planned)
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
            report["export"] = export(
                args.export_format, folder, model, config, tokenizer_config, result.config,
                args.gguf_type,
            )  # fmt: skip
        if args.report:
            target = staged_path(Path(args.report), save, folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(report, indent=2) + "\n")
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
        return min(build_tokenizer(tokenizer_config).vocab_size, model_vocab)
    except Exception:  # an unbuildable tokenizer is mg-eval's problem, not calibration's
        return model_vocab
