"""Decode tokens/s of mg-serve's whole-step AVX-512/AVX2 kernel (`vector_decode`) by the
kind of weights it reads: fp32, bf16, weight-only int8 and int4 (mg-quantize's modules).

The model is bench_serve.py's (SmolLM-135M's shape: 30 layers, hidden 576, 9 heads in 3
query groups, SwiGLU 1536, tied embeddings, vocabulary 50304) with random weights, in
fp32; its decoder linears are then held as each kind (int8: a scale per output channel;
int4: groups of `--group-size` columns, symmetric). The output layer is the tied fp32
embedding, as mg-quantize leaves it by default (`--quantize-output` quantizes an untied
copy too). The bf16 case is the whole model in bf16 (weights, activations rounded as the
eager bf16 model's, a bf16 KV cache: what `mg-serve --bf16` serves). Where AMX is there
and no instruction set is forced, the AMX bf16 step of the same model is timed too
(mg-serve's bf16 path on such a CPU).

Each case: `--batch` sequences prefilled with 16-token prompts, then `--steps` decode
steps, each one call of the fused step through `ModelRunner.forward` (`--op-by-op`:
the servable kinds' op-by-op steps too, what they ran before); the best of `--repeats`
rounds over all cases. The machine's load average is printed: the figures are indicative
where other work shares the CPU.

    .venv/bin/python bench/bench_vector_decode_weights.py --threads 2 --batch 1 8
    MG_CPU_ISA=avx2 .venv/bin/python bench/bench_vector_decode_weights.py --kinds fp32 int8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

PROMPT = 16
KINDS = ("fp32", "bf16", "int8", "int4")


def build_model(layers: int, kind: str, group_size: int, quantize_output: bool):
    """bench_serve.py's model (seed 0) with its decoder linears held as `kind` (bf16: the
    whole model)."""
    from mg.core.models import GPTModel
    from mg.core.quantization import primitives as P
    from mg.core.quantization.apply import set_submodule
    from mg.core.quantization.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_serve import smollm_135m_shape  # lazy: the same model as bench_serve.py's

    torch.manual_seed(0)
    config = smollm_135m_shape(layers, 2048, untied=quantize_output)
    model = GPTModel(config).eval()
    if kind == "bf16":
        return model.to(torch.bfloat16)
    for name, module in list(model.named_modules()):
        output = name == "output_layer"
        if type(module) is not nn.Linear or (output and not quantize_output):
            continue
        if kind == "int8":
            set_submodule(model, name, Int8WeightOnlyLinear.from_linear(module))
        elif kind == "int4":
            q, scale, zero = P.quantize_int4(module.weight.detach(), group_size)
            set_submodule(model, name, Int4WeightOnlyLinear.from_quantized(module, q, scale, zero))
    return model


def weight_megabytes(model: nn.Module) -> float:
    """The bytes of the weights a decode step reads (the embedding table's rows aside)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    embedding = model.embedding.word_embeddings.weight
    tied = model.output_layer is None
    return (total - (0 if tied else embedding.numel() * embedding.element_size())) / 1e6


def time_decode(runner, batch: int, steps: int) -> tuple[float, float]:
    """Decode tokens/s of `steps` steps of `batch` sequences: by the wall clock, and by the
    process's CPU time (with one thread, the time it ran: less moved by other work on a
    shared machine, which still shares the memory bandwidth)."""
    from mg.core.models.paged_kv_cache import PagedSegment

    per = -(-(PROMPT + steps) // runner.block_size)
    tables = [list(range(per * i, per * (i + 1))) for i in range(batch)]
    segments, ids, positions = [], [], []
    for i in range(batch):
        segments.append(PagedSegment(i * PROMPT, PROMPT, 0, tables[i]))
        ids += [(7 * i + j) % 50000 for j in range(PROMPT)]
        positions += range(PROMPT)
    runner.forward(segments, ids, positions, [PROMPT * (i + 1) - 1 for i in range(batch)])
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        decodes = [PagedSegment(i, 1, PROMPT + step, tables[i]) for i in range(batch)]
        runner.forward(decodes, [(step + i) % 50000 for i in range(batch)],
                       [PROMPT + step] * batch, list(range(batch)))  # fmt: skip
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return batch * steps / wall, batch * steps / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--group-size", type=int, default=64)  # 576 = 9 x 64
    parser.add_argument("--quantize-output", action="store_true")
    parser.add_argument(
        "--op-by-op", action="store_true", help="also time each servable kind's op-by-op step"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from mg.generate_server import cpu_isa
    from mg.generate_server.fused_decode import fused_decode_unsupported
    from mg.generate_server.packed_linears import pack_linears
    from mg.generate_server.runner import ModelRunner
    from mg.generate_server.vector_decode import VectorDecode, vector_isa

    max_length = PROMPT + args.steps
    print(f"CPU: {cpu_isa.describe(cpu_isa.chosen())}, kernel ISA {vector_isa()}, "
          f"{args.threads} threads, load average {os.getloadavg()}")  # fmt: skip
    cases = []
    for kind in args.kinds:
        model = build_model(args.layers, kind, args.group_size, args.quantize_output)
        runner = ModelRunner(model, max(args.batch), max_length, block_size=16)
        runner.choose_decode_attention()
        # (what `use_fused_decode` picks for these unpacked models, AMX or not)
        runner.fused_decode = VectorDecode(model, runner.cache)
        megabytes = weight_megabytes(model)
        cases.append((runner.fused_decode.description, kind, megabytes, runner))
        if args.op_by_op:
            plain = ModelRunner(model, max(args.batch), max_length, block_size=16)
            plain.choose_decode_attention()
            cases.append(("op by op", kind, megabytes, plain))
    if "bf16" in args.kinds and cpu_isa.chosen() == "amx":
        model = build_model(args.layers, "bf16", 0, False)
        megabytes = weight_megabytes(model)
        pack_linears(model)
        runner = ModelRunner(model, max(args.batch), max_length, block_size=16)
        runner.choose_decode_attention()
        if fused_decode_unsupported(model, runner.cache) is None and not runner.use_fused_decode():
            cases.append(("amx bf16 (bf16 model)", "bf16", megabytes, runner))
    columns = " | ".join(f"batch {b} tok/s (per CPU s)" for b in args.batch)
    print(f"| step | linears | weights MB | {columns} |")
    print("| --- | --- | ---: |" + " ---: |" * len(args.batch))
    best = {}  # (case, batch): the best (wall, CPU) rates; rounds over every case in turn,
    for _ in range(args.repeats):  # so that other work on the machine spreads over them all
        for c, (_, _, _, runner) in enumerate(cases):
            for b in args.batch:
                wall, cpu = time_decode(runner, b, args.steps)
                old = best.get((c, b), (0.0, 0.0))
                best[c, b] = (max(old[0], wall), max(old[1], cpu))
    for c, (description, kind, megabytes, _) in enumerate(cases):
        cells = " | ".join(f"{best[c, b][0]:.1f} ({best[c, b][1]:.1f})" for b in args.batch)
        print(f"| {description} | {kind} | {megabytes:.0f} | {cells} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
