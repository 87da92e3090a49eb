"""Throughput and memory of `mg-prep tokenize` against a plain loop (and Megatron, if present).

    uv run --frozen python bench/bench_prep.py                  # 200 MB corpus, workers 1 and 2
    uv run --frozen python bench/bench_prep.py --size-mb 20     # a quick run
    MEGATRON_LM_DIR=~/Megatron-LM uv run --frozen python bench/bench_prep.py

The corpus is JSONL made from the text fixtures (Shakespeare and Botchan
paragraphs, Wikipedia pages), repeated up to --size-mb (`--corpus repeated`),
or documents of 2 to 40 sentences drawn at random from them, so that no
document repeats and whole-document caches do not help (`--corpus shuffled`,
the default); cached under bench/.work/. Every contender tokenizes it with
GPT-2 BPE (or `--tokenizer sentencepiece`: Mistral's SentencePiece model as
Megatron's GPTSentencePieceTokenizer) and --append-eod into a document-level
dataset, each in its own process, side by side in one run:

- `mg-prep tokenize --workers N` for each N in --workers (gigatoken's Rust BPE
  encoding the workers' batches, the default where installed), and with
  `--tokenizer-backend classic` (mg.core's tiktoken-based GPT-2);
- gigatoken's file API with N threads: `encode_files(JsonlFileSource)` and
  the arrays written in bulk into a Megatron dataset with `--append-eod`'s
  semantics (what a gigatoken-based preprocess_data_fast.py does);
- baseline: one process, Hugging Face `tokenizers` GPT-2 `encode` per
  document + megatron-core's `IndexedDatasetBuilder` (the loop most people
  write first);
- Megatron-LM's tools/preprocess_data.py --legacy-tokenizer when
  $MEGATRON_LM_DIR points to a checkout (core_v0.16.1 was used) whose imports
  resolve in this environment (a stand-in `six` module is added for it);
  skipped otherwise.

Reported: wall time end to end (start-up included), MB/s and tokens/s over
that wall time, peak RSS of the whole process tree (sampled from /proc every
50 ms; psutil is not needed) and of its largest process, and whether each
output is byte-identical to the first mg-prep run's.

`--memory-mb N` adds one more mg-prep run on an N MB corpus to show that
peak memory does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
MIB = 1 << 20


# --- corpus ----------------------------------------------------------------------------------


def make_corpus(size_mb: int, kind: str = "shuffled") -> Path:
    """A JSONL corpus of at least size_mb MiB from the fixtures, cached by size and kind."""
    from mg.corpus_prep.sample_corpus import (
        botchan_documents,
        shakespeare_documents,
        wikipedia_documents,
    )

    path = WORK / f"corpus-{kind}-{size_mb}mb.jsonl"
    if path.exists() and path.stat().st_size >= size_mb * MIB:
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    base = [*shakespeare_documents(), *botchan_documents(), *wikipedia_documents()]
    target = size_mb * MIB
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        if kind == "repeated":
            lines = [json.dumps({"text": d["text"]}, ensure_ascii=False) + "\n" for d in base]
            block = "".join(lines).encode("utf-8")
            for _ in range(-(-target // len(block))):
                out.write(block)
        else:
            _write_shuffled(out, [d["text"] for d in base], target)
    tmp.rename(path)
    return path


def _write_shuffled(out, texts: list[str], target: int) -> None:
    """Documents of 2 to 40 sentences drawn at random (seeded) from `texts`, `target` bytes."""
    import random

    sentences = [s for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if s.strip()]
    rng = random.Random(0)
    written = 0
    while written < target:
        text = " ".join(rng.choices(sentences, k=rng.randint(2, 40)))
        line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")
        out.write(line)
        written += len(line)


# --- measuring -------------------------------------------------------------------------------


def _tree_rss(root: int) -> tuple[int, int]:
    """(sum, max) of VmRSS in bytes over `root` and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[pid] = int(line.split()[1]) * 1024
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    values = [rss.get(pid, 0) for pid in tree]
    return sum(values), max(values, default=0)


@dataclass
class Result:
    name: str
    seconds: float
    peak_total: int
    peak_process: int
    output: str | None
    ok: bool
    note: str = ""
    processing: float | None = None  # seconds after start-up, as the contender reports them


def measure(name: str, command: list[str], output_prefix: str | None, env=None) -> Result:
    """Run `command`, sampling the RSS of its process tree; return timings and peaks."""
    peaks = [0, 0]
    start = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total, largest = _tree_rss(process.pid)
            peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], largest)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log, _ = process.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    ok = process.returncode == 0 and (
        output_prefix is None or os.path.exists(output_prefix + ".idx")
    )
    if not ok:
        print(f"  {name} failed (exit {process.returncode}):\n{log[-2000:]}", file=sys.stderr)
    reported = re.search(r"(?:tokens from .* in|processing seconds:) ([\d.]+) s", log)
    processing = float(reported.group(1)) if reported else None
    return Result(name, seconds, peaks[0], peaks[1], output_prefix, ok, processing=processing)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def count_tokens(prefix: str) -> int:
    from mg.indexed_dataset.format import IndexedDataset

    return IndexedDataset(prefix).num_tokens


# --- contenders ------------------------------------------------------------------------------


def gpt2_files() -> tuple[str, str]:
    from mg.core.fixtures import fixture_path

    return str(fixture_path("gpt2-bpe", "vocab.json")), str(fixture_path("gpt2-bpe", "merges.txt"))


def sentencepiece_file() -> str:
    from mg.core.fixtures import fixture_path

    return str(fixture_path("mistral-spm", "tokenizer.model"))


TOKENIZERS = {"gpt2": "GPT-2 BPE", "sentencepiece": "SentencePiece (Mistral's tokenizer.model)"}


def tokenizer_flags(tokenizer: str) -> list[str]:
    """`--tokenizer-type` and its files, as mg-prep and Megatron's preprocess_data.py take them."""
    if tokenizer == "sentencepiece":
        return ["--tokenizer-type", "GPTSentencePieceTokenizer",
                "--tokenizer-model", sentencepiece_file()]  # fmt: skip
    vocab, merges = gpt2_files()
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


def mg_prep_command(
    corpus: Path, prefix: str, workers: int, backend: str = "auto", tokenizer: str = "gpt2"
) -> list[str]:
    return [
        str(Path(sys.executable).parent / "mg-prep"), "tokenize", "--input", str(corpus),
        "--output-prefix", prefix, *tokenizer_flags(tokenizer), "--append-eod",
        "--workers", str(workers), "--no-progress-bar", "--log-interval", "1000000000",
        "--tokenizer-backend", backend,
    ]  # fmt: skip


def gigatoken_main(corpus: str, prefix: str, threads: str, kind: str) -> None:
    """gigatoken's file API on `threads` threads, written in bulk as Megatron's dataset."""
    os.environ["RAYON_NUM_THREADS"] = threads  # before gigatoken starts its pool
    import awkward as ak
    import gigatoken
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from mg.corpus_prep.gigatoken_backend import gpt2_tokenizer_json, sentencepiece_tokenizer_json

    if kind == "sentencepiece":
        tokenizer = gigatoken.Tokenizer.from_json(
            sentencepiece_tokenizer_json(sentencepiece_file())
        )
        eod = 2  # </s>: Megatron's GPTSentencePieceTokenizer's eod, sp.eos_id()
    else:
        vocab_file, merge_file = gpt2_files()
        tokenizer = gigatoken.Tokenizer.from_json(gpt2_tokenizer_json(vocab_file, merge_file))
        eod = tokenizer.vocab_size - 1  # <|endoftext|>, the last of GPT-2's ids
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    start = time.perf_counter()
    ids = tokenizer.encode_files(gigatoken.JsonlFileSource([corpus], "text"), parallel=True)
    lengths = ak.to_numpy(ak.num(ids)).astype(np.int64)
    flat = ak.to_numpy(ak.flatten(ids))
    kept = lengths > 0
    with_eod = lengths + kept
    tokens = np.empty(int(with_eod.sum()), dtype=dtype)
    is_eod = np.zeros(tokens.size, dtype=bool)
    is_eod[np.cumsum(with_eod)[kept] - 1] = True
    tokens[~is_eod] = flat
    tokens[is_eod] = eod
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    builder.data_file.write(tokens.tobytes())
    builder.sequence_lengths = with_eod[kept].tolist()
    builder.document_indices = [0, *np.cumsum(kept).tolist()]
    builder.finalize(prefix + ".idx")
    print(f"processing seconds: {time.perf_counter() - start:.2f} s")


def baseline_main(corpus: str, prefix: str, kind: str) -> None:
    """The plain loop: HF tokenizers GPT-2 encode (or sentencepiece's) per document +
    megatron-core's builder."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if kind == "sentencepiece":
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_file())
        builder = IndexedDatasetBuilder(
            prefix + ".bin", dtype=DType.optimal_dtype(processor.vocab_size())
        )
        start = time.perf_counter()
        with open(corpus, encoding="utf-8") as fin:
            for line in fin:
                ids = processor.encode(json.loads(line)["text"])
                if ids:
                    ids.append(processor.eos_id())
                builder.add_document(ids, [len(ids)] if ids else [])
        builder.finalize(prefix + ".idx")
        print(f"processing seconds: {time.perf_counter() - start:.2f} s")
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_file, merge_file = gpt2_files()
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    eod = vocab["<|endoftext|>"]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(len(vocab)))
    start = time.perf_counter()
    with open(corpus, encoding="utf-8") as fin:
        for line in fin:
            ids = tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids
            if ids:
                ids.append(eod)
            builder.add_document(ids, [len(ids)] if ids else [])
    builder.finalize(prefix + ".idx")
    print(f"processing seconds: {time.perf_counter() - start:.2f} s")


def megatron_command(
    megatron_dir: Path, corpus: Path, prefix: str, workers: int, tokenizer: str = "gpt2"
) -> list[str]:
    return [
        sys.executable, str(megatron_dir / "tools" / "preprocess_data.py"),
        "--input", str(corpus), "--output-prefix", prefix, *tokenizer_flags(tokenizer),
        "--append-eod", "--workers", str(workers), "--log-interval", "1000000000",
        "--legacy-tokenizer",  # core_v0.14+; the classic GPT-2 / SentencePiece tokenizers
    ]  # fmt: skip


# --- report ----------------------------------------------------------------------------------


def report(results: list[Result], corpus: Path, tokenizer: str = "gpt2") -> None:
    size = corpus.stat().st_size
    reference = next((r for r in results if r.ok and r.output), None)
    ref_hash = None
    if reference is not None:
        ref_hash = (sha256(reference.output + ".bin"), sha256(reference.output + ".idx"))
        tokens = count_tokens(reference.output)
    print(f"\ncorpus: {corpus} ({size / MIB:,.0f} MiB), {TOKENIZERS[tokenizer]}, --append-eod")
    header = (
        f"{'contender':<34} {'wall s':>7} {'MB/s':>6} {'Mtok/s':>6} | {'run s':>6} {'MB/s':>6} "
        f"| {'RSS tree':>9} {'largest':>8} | same bytes"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if not r.ok:
            print(f"{r.name:<34} failed {r.note}")
            continue
        same = "-"
        if ref_hash and r.output and os.path.exists(r.output + ".idx"):
            hashes = (sha256(r.output + ".bin"), sha256(r.output + ".idx"))
            same = "yes" if hashes == ref_hash else "NO"
        run = (
            f"{r.processing:>6.1f} {size / MIB / r.processing:>6.2f}"
            if r.processing
            else f"{'-':>6} {'-':>6}"
        )
        print(
            f"{r.name:<34} {r.seconds:>7.1f} {size / MIB / r.seconds:>6.2f} "
            f"{tokens / r.seconds / 1e6:>6.3f} | {run} | {r.peak_total / MIB:>6.0f} MB "
            f"{r.peak_process / MIB:>5.0f} MB | {same}"
        )
    print(
        "wall: end to end, start-up included; run: after start-up, as each reports it; "
        "RSS: peak of the process tree (sum) and of its largest process"
    )
    for label in ("baseline", "gigatoken file API", "Megatron"):
        ratios(results, label)


def ratios(results: list[Result], label: str) -> None:
    """Each contender's throughput over that of the first contender named `label`, or of the
    one with the same thread count (`, N threads` / `-wN` / `--workers N`)."""
    bases = [r for r in results if r.name.startswith(label) and r.ok]
    if not bases:
        return
    print()
    for r in results:
        if not r.ok or r.name.startswith(label):
            continue
        base = next((b for b in bases if _threads(b.name) == _threads(r.name)), bases[0])
        line = f"{r.name}: {base.seconds / r.seconds:.2f}x {base.name}'s throughput end to end"
        if r.processing and base.processing:
            line += f", {base.processing / r.processing:.2f}x after start-up"
        print(line)


def _threads(name: str) -> str | None:
    found = re.search(r"(?:--workers |-w|, )(\d+)", name)
    return found.group(1) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=200, help="corpus size (default 200)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--memory-mb", type=int, default=0, help="also run mg-prep on a corpus this big"
    )
    parser.add_argument(
        "--corpus",
        choices=("shuffled", "repeated"),
        default="shuffled",
        help="documents drawn at random from the fixtures' sentences (default), or the "
        "fixtures' documents repeated",
    )
    parser.add_argument("--no-gigatoken", action="store_true", help="skip gigatoken's file API")
    parser.add_argument("--no-classic", action="store_true", help="skip the classic backend")
    parser.add_argument("--keep", action="store_true", help="keep the outputs in bench/.work")
    parser.add_argument(
        "--tokenizer", choices=tuple(TOKENIZERS), default="gpt2", help="every contender's"
    )
    parser.add_argument("--_baseline", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--_gigatoken", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._baseline:
        baseline_main(*args._baseline)
        return 0
    if args._gigatoken:
        gigatoken_main(*args._gigatoken)
        return 0

    corpus = make_corpus(args.size_mb, args.corpus)
    out = WORK / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    results = []
    for workers in args.workers:
        prefix = str(out / f"mg{workers}")
        command = mg_prep_command(corpus, prefix, workers, tokenizer=args.tokenizer)
        results.append(measure(f"mg-prep --workers {workers}", command, prefix + "_text_document"))
    if not args.no_classic:
        for workers in args.workers:
            prefix = str(out / f"classic{workers}")
            command = mg_prep_command(corpus, prefix, workers, "classic", args.tokenizer)
            name = f"mg-prep -w{workers} classic backend"
            results.append(measure(name, command, prefix + "_text_document"))
    if not args.no_gigatoken:
        for threads in args.workers:
            prefix = str(out / f"gigatoken{threads}")
            command = [sys.executable, __file__, "--_gigatoken", str(corpus), prefix, str(threads),
                       args.tokenizer]  # fmt: skip
            results.append(measure(f"gigatoken file API, {threads} threads", command, prefix, env))
    if not args.no_baseline:
        prefix = str(out / "baseline")
        command = [sys.executable, __file__, "--_baseline", str(corpus), prefix, args.tokenizer]
        loop = "sentencepiece" if args.tokenizer == "sentencepiece" else "HF tokenizers"
        results.append(measure(f"baseline ({loop} loop)", command, prefix, env))
    megatron_dir = os.environ.get("MEGATRON_LM_DIR")
    if megatron_dir:
        # its bert_tokenization.py imports `six`: a stand-in where it is not installed
        # (never over the real one, which other packages import more from)
        if importlib.util.find_spec("six") is None:
            shims = WORK / "megatron-shims"
            shims.mkdir(exist_ok=True)
            (shims / "six.py").write_text("PY2 = False\nPY3 = True\n")
            env = {**env, "PYTHONPATH": str(shims)}
        for workers in args.workers:
            prefix = str(out / f"megatron{workers}")
            command = megatron_command(Path(megatron_dir), corpus, prefix, workers, args.tokenizer)
            results.append(
                measure(
                    f"Megatron preprocess_data.py -w{workers}",
                    command,
                    prefix + "_text_document",
                    env,
                )
            )
    else:
        print("MEGATRON_LM_DIR not set: skipping Megatron-LM's preprocess_data.py")
    report(results, corpus, args.tokenizer)
    if args.memory_mb:
        big = make_corpus(args.memory_mb)
        workers = max(args.workers)
        prefix = str(out / "big")
        result = measure(
            f"mg-prep --workers {workers}",
            mg_prep_command(big, prefix, workers, tokenizer=args.tokenizer),
            prefix + "_text_document",
        )
        report([result], big, args.tokenizer)
        big.unlink()
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
