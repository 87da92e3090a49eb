"""Perplexity change of every mg-quantize recipe on held-out text, one trained model.

A Llama-shaped model (GPT-2 BPE vocabulary) is trained on Botchan (characters
20000:200000, core's `train_on_botchan`), or read with `--load`; calibration windows
come from the training text (20000:60000), held-out windows from text it never saw
(200000:270000). Each recipe then runs through `mg-quantize` with `--eval-data-path`,
which reports the perplexity before and after with core's model forward.

    uv run --frozen python bench/bench_quantize_quality.py --steps 400 --out table.md

With `--data-path PREFIX --split 98,2,0` (the dataset the `--load` checkpoint was
trained on, made with its tokenizer) the held-out windows are the validation split's
documents (Megatron's document split, as mg-train and mg-eval take it) and calibration
windows come from documents spread over the training split, in a fixed shuffled order.

    uv run --frozen python bench/bench_quantize_quality.py --load ckpt \
        --data-path data/corpus_text_document --split 98,2,0 --out table.md

`--outlier-channels K --outlier-scale C` first rewrites the model into an equivalent one
with the activation outliers large LLMs have (LLM.int8(), AWQ): in every layer the
RMSNorm gains of the same K hidden channels are multiplied by C and the matching input
columns of linear_qkv and linear_fc1 divided by C. The float model's logits do not change
(checked, printed); its quantized linears now see K input channels C times larger than
the rest, with C times smaller weights, which is what AWQ is built to protect.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

RECIPES = [
    ("int8_wo", []),
    ("fp8", []),
    ("fp8", ["--fp8-per-channel"]),
    ("int8_sq", []),
    ("int4_wo", ["--group-size", "128"]),
    ("int4_awq", ["--group-size", "128"]),
    ("int4_awq", ["--group-size", "128", "--awq-clip"]),
    ("int4_gptq", ["--group-size", "128"]),
    ("int4_gptq", ["--group-size", "128", "--act-order"]),
    ("int4_wo", ["--group-size", "32"]),
]


def _dataset(prefix: Path, tokenizer, start: int, end: int) -> str:
    import numpy as np

    from mg.core.fixtures import fixture_path
    from mg.indexed_dataset import IndexedDatasetBuilder

    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")[start:end]
    with IndexedDatasetBuilder(f"{prefix}.bin", np.int32) as builder:
        for k in range(0, len(text), 2000):
            ids = tokenizer.tokenize(text[k : k + 2000])
            builder.add_document(ids, [len(ids)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _split_datasets(prefix: str, split: str, tmp: Path) -> tuple[str, str, int]:
    """(calibration prefix, held-out prefix, held-out documents) from one indexed dataset:
    the validation split's documents, and up to 64 training documents spread evenly over
    the training split, shuffled with seed 0 (so calibration mixes the corpus's sources)."""
    import numpy as np

    from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from mg.indexed_dataset.split import Split, parse_split, split_matrix, split_range

    with IndexedDataset(prefix) as dataset:
        bookends = split_matrix(parse_split(split))
        train = split_range(bookends[Split.train.value], len(dataset))
        valid = split_range(bookends[Split.valid.value], len(dataset))
        picked = train[np.linspace(0, len(train) - 1, min(64, len(train))).astype(int)]
        picked = np.random.default_rng(0).permutation(picked)

        def write(name: str, ids) -> str:
            out = tmp / name
            with IndexedDatasetBuilder(f"{out}.bin", np.int32) as builder:
                for i in ids:
                    tokens = np.asarray(dataset[int(i)], dtype=np.int32)
                    builder.add_document(tokens, [len(tokens)])
                builder.finalize(f"{out}.idx")
            return str(out)

        return write("calib", picked), write("heldout", valid), len(valid)


def _add_outlier_channels(model, count: int, scale: float) -> str:
    """The equivalent model with `count` outlier channels `scale` times larger (see the
    module docstring); returns a sentence for the table saying what changed."""
    import torch

    probe = torch.randint(
        0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        before = model(probe)
        channels = torch.randperm(
            model.config.hidden_size, generator=torch.Generator().manual_seed(0)
        )[:count]
        for layer in model.decoder.layers:
            for norm, linear in (
                (layer.input_layernorm, layer.self_attention.linear_qkv),
                (layer.pre_mlp_layernorm, layer.mlp.linear_fc1),
            ):
                norm.weight[channels] *= scale
                linear.weight[:, channels] /= scale
        after = model(probe)
    change = float((after - before).abs().max() / before.abs().max())
    print(f"outlier channels {channels.tolist()}: logits change {change:.1e}", file=sys.stderr)
    return (
        f", rewritten with {count} outlier channels {scale:g}x larger before linear_qkv and "
        f"linear_fc1 (same function: float logits change {change:.1e} relative)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", help="an mg checkpoint with a GPT-2 BPE tokenizer")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--data-path", help="with --load: the dataset it was trained on")
    parser.add_argument("--split", default="98,2,0", help="with --data-path: held out = valid")
    parser.add_argument(
        "--gptq-calib-samples", type=int, help="fewer calibration windows for GPTQ (slow on CPU)"
    )
    parser.add_argument("--recipes", help="comma-separated row numbers of RECIPES to run")
    parser.add_argument("--outlier-channels", type=int, default=0, help="K: see the docstring")
    parser.add_argument("--outlier-scale", type=float, default=20.0, help="C: see the docstring")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from mg.core.checkpoint import load_model, save_model
    from mg.core.fixtures import fixture_path
    from mg.core.models import GPTModel
    from mg.core.models.presets import tiny_llama
    from mg.core.testing.botchan_training import train_on_botchan
    from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    from mg.quantize_export import cli

    tok_config = TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )
    tokenizer = build_tokenizer(tok_config)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        if args.load:
            source = args.load
            model, config, tok_config, _ = load_model(source)
        else:
            torch.manual_seed(0)
            config = tiny_llama(
                vocab_size=50304, hidden_size=args.hidden, num_layers=args.layers,
                num_attention_heads=args.hidden // 64, num_query_groups=args.hidden // 128,
                ffn_hidden_size=args.ffn, seq_length=args.seq, max_position_embeddings=args.seq,
            )  # fmt: skip
            model = train_on_botchan(
                GPTModel(config), tokenizer, steps=args.steps, window=args.seq, batch_size=8,
                text_end=200000,
            )  # fmt: skip
            source = str(tmp / "float")
            save_model(source, model, config, tok_config)
        outlier_text = ""
        if args.outlier_channels:
            outlier_text = _add_outlier_channels(model, args.outlier_channels, args.outlier_scale)
            source = str(tmp / "outliers")
            save_model(source, model, config, tok_config)
        params = sum(p.numel() for p in model.parameters())
        linear = sum(
            m.weight.numel()
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "output_layer"
        )
        trained_s = time.perf_counter() - start
        del model
        if args.data_path:
            calib, heldout, n_heldout = _split_datasets(args.data_path, args.split, tmp)
            data_text = (
                f"held out: the {n_heldout} validation documents of --split {args.split}; "
                "calibration: training documents spread over the split"
            )
        else:
            calib = _dataset(tmp / "calib", tokenizer, 20000, 60000)
            heldout = _dataset(tmp / "heldout", tokenizer, 200000, 270000)
            data_text = "held out: Botchan 200000:270000; calibration: Botchan 20000:60000"
        chosen = RECIPES
        if args.recipes:
            chosen = [RECIPES[int(i)] for i in args.recipes.split(",")]
        rows = []
        for recipe, extra in chosen:
            report = tmp / "report.json"
            out = tmp / "q"
            calib_samples = args.calib_samples
            if recipe == "int4_gptq" and args.gptq_calib_samples:
                calib_samples = args.gptq_calib_samples
            began = time.perf_counter()
            cli.main(
                ["--no-progress", "--overwrite", "--load", source, "--save", str(out),
                 "--recipe", recipe, *extra, "--calib-data-path", calib,
                 "--calib-samples", str(calib_samples), "--calib-seq-length", str(args.seq),
                 "--eval-data-path", heldout, "--eval-samples", str(args.eval_samples),
                 "--report", str(report)]
            )  # fmt: skip
            data = json.loads(report.read_text())
            data["calib_samples"] = calib_samples
            data["seconds"] = time.perf_counter() - began
            rows.append((recipe, " ".join(extra), data))
            print(
                recipe, extra, data["ppl_before"], data["ppl_after"], data["kl_divergence"],
                f"{data['seconds']:.0f} s", file=sys.stderr, flush=True,
            )  # fmt: skip
    base = rows[0][2]["ppl_before"]
    rtn = next((d for r, e, d in rows if r == "int4_wo" and "128" in e), None)
    int4_rtn = rtn["ppl_change_pct"] if rtn else None
    int4_rtn_kl = rtn["kl_divergence"] if rtn else None
    lines = [
        f"model: {params / 1e6:.1f}M parameters ({linear / 1e6:.1f}M in the quantized linears; "
        f"hidden {config.hidden_size}, {config.num_layers} layers, ffn {config.ffn_hidden_size}, "
        f"vocab {config.vocab_size}), "
        + (f"--load {args.load}" if args.load else f"trained {args.steps} steps on Botchan")
        + f" ({trained_s:.0f} s){outlier_text}; held-out perplexity {base:.3f} on "
        f"{args.eval_samples} "
        f"windows of {args.seq} tokens ({data_text}); calibration {args.calib_samples} "
        f"windows; {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end",
        "",
        "| recipe | options | calibration windows | perplexity | change | vs int4_wo g128 "
        "| KL divergence (mean, nats) | KL vs int4_wo g128 | KL p99 | same top token "
        "| size vs float | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for recipe, extra, data in rows:
        calibrated = recipe not in ("int8_wo", "int4_wo")
        versus = kl_versus = ""
        if recipe.startswith("int4") and int4_rtn and int4_rtn > 0:
            versus = f"{data['ppl_change_pct'] / int4_rtn:.2f}x"
        if recipe.startswith("int4") and int4_rtn_kl:
            kl_versus = f"{data['kl_divergence'] / int4_rtn_kl:.2f}x"
        lines.append(
            f"| {recipe} | {extra} | {data['calib_samples'] if calibrated else ''} | "
            f"{data['ppl_after']:.3f} | {data['ppl_change_pct']:+.3f}% | {versus} | "
            f"{data['kl_divergence']:.5f} | {kl_versus} | {data['kl_divergence_p99']:.4f} | "
            f"{data['same_top_token_pct']:.2f}% | "
            f"{data['size_after_bytes'] / data['size_before_bytes']:.2f}x | "
            f"{data['seconds']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
