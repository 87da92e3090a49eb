"""Training step time of a fixed GPT at TP=2 vs TP=1 on CPU, and the communication share.

The reference is the same model, batch and AdamW step in one process (TP=1);
TP=2 runs as two gloo ranks of this script (each with half the threads, so
both use the same cores). Each rank times `--steps` steps after `--warmup`
(forward + vocab-parallel loss, backward, `sync_tensor_parallel_grads`,
`clip_grad_norm` over shards, AdamW) and then profiles `--profile-steps` more
with torch.profiler; the communication share is the CPU time of the
collectives (all-reduce, all-gather, reduce-scatter and their waits) over the
profiled step time, on rank 0.

    uv run --frozen python bench/bench_tp.py
    uv run --frozen python bench/bench_tp.py --layers 2 --hidden 256 --seq 128 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mg.core.models import GPTModel, presets

# Profiler names of the collectives (gloo:, c10d::, _c10d_functional:: ops and the waits).
COMM_MARKERS = ("gloo:", "c10d", "wait_tensor")


def _config(a: argparse.Namespace):
    return presets.tiny_gpt2(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        seq_length=a.seq,
        max_position_embeddings=a.seq,
        vocab_size=a.vocab,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def _step(model, opt, tokens, tp: int) -> None:
    from mg.core.parallel.grad_norm import clip_grad_norm
    from mg.core.parallel.tensor_parallel import sync_tensor_parallel_grads

    opt.zero_grad(set_to_none=True)
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    if tp > 1:
        sync_tensor_parallel_grads(model)
        clip_grad_norm(model.parameters(), 1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _run(a: argparse.Namespace, tp: int) -> dict:
    """Time and profile the step on this rank (tp ranks when under torch.distributed)."""
    torch.manual_seed(0)
    model = GPTModel(_config(a))
    if tp > 1:
        from mg.core.parallel import ParallelDims
        from mg.core.parallel.tensor_parallel import apply_tensor_parallel

        mesh = ParallelDims.from_world(tp, tp=tp).build_mesh()
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=a.sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(
        0, a.vocab, (a.mbs, a.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    for _ in range(a.warmup):
        _step(model, opt, tokens, tp)
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        _step(model, opt, tokens, tp)
        times.append(time.perf_counter() - start)
    comm_us = total_us = 0.0
    if tp > 1:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(a.profile_steps):
                _step(model, opt, tokens, tp)
            total_us = (time.perf_counter() - start) * 1e6
        for event in prof.key_averages():
            name = event.key.lower()
            if any(marker in name for marker in COMM_MARKERS):
                comm_us += event.self_cpu_time_total
    return {"step_s": statistics.median(times), "comm_us": comm_us, "total_us": total_us}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_tp(a: argparse.Namespace, tp: int, threads: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "rank0.json"
    env = dict(os.environ, WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(_free_port()), OMP_NUM_THREADS=str(threads))
    argv = [sys.executable, __file__, *sys.argv[1:], "--worker", str(out)]
    procs = [
        subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(tp)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("TP ranks failed")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        result = _run(a, int(os.environ["WORLD_SIZE"]))
        if dist.get_rank() == 0:
            Path(a.worker).write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        return
    torch.set_num_threads(a.threads)
    one = _run(a, 1)
    tp = _launch_tp(a, a.tp, max(1, a.threads // a.tp))
    params = sum(t.numel() for t in GPTModel(_config(a)).parameters())
    print(
        f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, "
        f"vocab {a.vocab}, mbs {a.mbs}: {params / 1e6:.1f} M params; {a.threads} threads "
        f"in all; sequence parallel: {a.sequence_parallel}"
    )
    print(f"TP=1 (reference)  step {one['step_s'] * 1e3:8.1f} ms")
    print(
        f"TP={a.tp}             step {tp['step_s'] * 1e3:8.1f} ms   "
        f"ratio TP{a.tp}/TP1 {tp['step_s'] / one['step_s']:.2f}x"
    )
    share = tp["comm_us"] / tp["total_us"] if tp["total_us"] else float("nan")
    print(f"communication share of the TP={a.tp} step (rank 0, profiled): {share:.1%}")


if __name__ == "__main__":
    main()
