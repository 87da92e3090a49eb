"""The demo's last step: a loss plot and a summary table from what the tools wrote.

    python workflows/demo/report.py --train-log demo-output/train.log \
        --data-prefix demo-output/data/corpus_text_document --seq-length 128 \
        --eval-report demo-output/report.jsonl --export demo-output/hf \
        --quantized-report demo-output/report_int8.jsonl \
        --quantize-report demo-output/quantize_int8.json \
        --served demo-output/served_api.json demo-output/served_openai.json \
        --output-dir demo-output

reads mg-train's log lines (Megatron's format), the dataset, mg-eval's reports (of
the float checkpoint and of its int8 copy from mg-quantize) and the server's answers,
and writes `loss.png` (training and validation loss against the unigram level of the
data: what a model that learned nothing but token frequencies scores) and
`summary.md`, which it also prints.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np

TRAIN = re.compile(
    r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
    r".*?\(TFLOP/s/GPU\): ([\d.]+) \|(?: MFU: ([\d.]+)% \|)?.*?global batch size: +(\d+) \|"
    r".*? lm loss: ([\d.E+-]+) \|"
)
VALID = re.compile(r"validation loss at iteration (\d+)[^|]*\| lm loss value: ([\d.E+-]+)")
# which validation samples the line scored (mg-train names them; mg-eval ppl scores others)
VALID_SAMPLES = re.compile(r"\| samples: (\d+)-(\d+) of the (\d+) built from the validation split")


def last_valid_samples(path: Path) -> str:
    """' on samples A-B of the N built from the split', from the last validation line."""
    found = VALID_SAMPLES.findall(path.read_text(encoding="utf-8", errors="replace"))
    if not found:
        return ""
    first, last, built = found[-1]
    return f", samples {first}-{last} of the {built} built from the validation split"


def read_log(path: Path) -> tuple[list[dict], list[tuple[int, float]]]:
    train, valid = [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if m := TRAIN.search(line):
            it, ms, tflops, mfu, gbs, loss = m.groups()
            train.append(
                dict(
                    it=int(it),
                    ms=float(ms),
                    tflops=float(tflops),
                    mfu=float(mfu) if mfu else None,
                    gbs=int(gbs),
                    loss=float(loss),
                )
            )
        elif m := VALID.search(line):
            valid.append((int(m.group(1)), float(m.group(2))))
    return train, valid


def unigram_loss(prefix: str) -> tuple[float, int, int]:
    """Cross entropy (nats) of the data under its own token frequencies; tokens; documents."""
    from mg.indexed_dataset import IndexedDataset

    with IndexedDataset(prefix) as dataset:
        counts = np.zeros(0, dtype=np.int64)
        for sequence in dataset:
            found = np.bincount(np.asarray(sequence, dtype=np.int64))
            if found.size > counts.size:
                counts = np.pad(counts, (0, found.size - counts.size))
            counts[: found.size] += found
        tokens, documents = int(counts.sum()), dataset.num_documents
    p = counts[counts > 0] / tokens
    return float(-(p * np.log(p)).sum()), tokens, documents


def plot(train: list[dict], valid: list[tuple[int, float]], unigram: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    ax.plot([r["it"] for r in train], [r["loss"] for r in train], label="training loss")
    if valid:
        ax.plot(*zip(*valid, strict=True), "o-", label="validation loss")
    ax.axhline(unigram, color="grey", linestyle="--", label=f"unigram level ({unigram:.2f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats/token)")
    ax.set_title("mg demo: a 4-layer GPT on Botchan, Shakespeare and Wikipedia")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def served_text(path: Path) -> str:
    """The completion text of a Megatron PUT /api or an OpenAI /v1/completions answer."""
    data = json.loads(path.read_text())
    if "choices" in data:
        return data["choices"][0]["text"]
    return data["text"][0] if isinstance(data.get("text"), list) else str(data)


def last_metrics(path: Path) -> dict:
    """The metrics of the last line of an mg-eval report (JSON lines)."""
    return json.loads(path.read_text().splitlines()[-1])["metrics"]


def quantized_row(float_ppl: float | None, report: Path, quantize: Path | None) -> str:
    """mg-eval's perplexity of the quantized checkpoint beside the float one, and the sizes."""
    ppl = last_metrics(report)["ppl"]
    text = f"ppl {ppl:.4g}"
    if float_ppl:
        text += f" ({100 * (ppl / float_ppl - 1):+.2f}% against the float {float_ppl:.4g})"
    if quantize is not None and quantize.is_file():
        q = json.loads(quantize.read_text())
        mib = 2**20
        text += (
            f"; {q['quantized_linears']} linears in int8, checkpoint weights "
            f"{q['size_before_bytes'] / mib:.2f} → {q['size_after_bytes'] / mib:.2f} MiB"
        )
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-log", type=Path, required=True)
    p.add_argument("--data-prefix", required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--eval-report", type=Path)
    p.add_argument("--quantized-report", type=Path, help="mg-eval's report of mg-quantize's copy")
    p.add_argument("--quantize-report", type=Path, help="mg-quantize's --report (sizes)")
    p.add_argument("--export")
    p.add_argument("--served", type=Path, nargs="*", default=[])
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--seconds", type=int, help="the demo's wall time so far")
    args = p.parse_args()

    train, valid = read_log(args.train_log)
    if not train:
        raise SystemExit(f"{args.train_log}: no mg-train iteration lines in it")
    unigram, tokens, documents = unigram_loss(args.data_prefix)
    png = args.output_dir / "loss.png"
    plot(train, valid, unigram, png)

    steady = train[1:] or train  # the first interval includes start-up
    ms = sum(r["ms"] for r in steady) / len(steady)
    tokens_per_s = train[-1]["gbs"] * args.seq_length / (ms / 1000)
    tflops = sum(r["tflops"] for r in steady) / len(steady)
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    mfu = f", MFU {sum(mfus) / len(mfus):.1f}% of the CPU peak estimate" if mfus else ""
    final = valid[-1][1] if valid else train[-1]["loss"]
    seen = train[-1]["it"] * train[-1]["gbs"] * args.seq_length
    rows = [
        ("data", f"{documents:,} documents, {tokens:,} tokens"),
        ("unigram level", f"{unigram:.3f} nats/token (perplexity {math.exp(unigram):,.0f})"),
        (
            "training",
            f"{train[-1]['it']} iterations, {seen:,} tokens ({seen / tokens:.1f} epochs), "
            f"{tokens_per_s:,.0f} tokens/s, {tflops:.4f} TFLOP/s{mfu}",
        ),
        (
            "final loss",
            f"training {train[-1]['loss']:.3f}, validation {final:.3f} nats/token "
            f"({unigram - final:.2f} below the unigram level)",
        ),
        (
            "perplexity",
            f"{math.exp(min(final, 20)):,.1f} (mg-train's last validation"
            f"{last_valid_samples(args.train_log)})",
        ),
    ]
    float_ppl = None
    if args.eval_report and args.eval_report.is_file():
        metrics = last_metrics(args.eval_report)
        float_ppl = metrics.get("ppl")
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
        if "split_samples" in metrics:  # other samples than the validation's: another number
            shown += (
                f" (samples 0-{metrics['num_samples'] - 1} of the {metrics['split_samples']} "
                f"in one pass over the {metrics['split']} split)"
            )
        rows.append(("mg-eval ppl", shown))
    if args.quantized_report and args.quantized_report.is_file():
        row = quantized_row(float_ppl, args.quantized_report, args.quantize_report)
        rows.append(("mg-eval ppl, int8_wo", row))
    if args.export:
        rows.append(("export", args.export))
    for path in args.served:
        if path.is_file():
            rows.append((f"served ({path.stem})", repr(served_text(path))))
    rows.append(("loss plot", str(png)))
    if args.seconds is not None:
        rows.append(("demo wall time", f"{args.seconds} s"))
    table = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]
    (args.output_dir / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
