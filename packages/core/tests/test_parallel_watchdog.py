"""A rank that dies or hangs mid-step ends the whole 2-rank job within the timeout.

The job is a 1F1B pipeline (P=2) training a tiny GPT with
`--distributed-timeout-minutes 0.2` (12 s) on the watchdog, which bounds every
send/receive of the schedule; this file is also the rank worker
(`python test_parallel_watchdog.py MODE OUT_DIR`). In step 1, rank 1 either
`os._exit`s in the middle of its forward pass (a crash) or blocks inside a
guarded operation that never completes (a hang). Each rank records when it
went down; rank 0, waiting for a gradient from rank 1, must exit non-zero
within the timeout (plus scheduling slack) with a message naming its rank,
its pipeline stage and the operation.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mg.core.models import GPTModel, presets
from mg.core.parallel import watchdog
from mg.core.parallel.pipeline import split_model
from mg.core.parallel.pipeline_schedule import build_schedule, run_schedule
from mg.core.testing.launch import run_ranks

TIMEOUT_MINUTES = 0.2  # 12 s: long enough that a loaded box does not trip it by itself
SLACK_S = 6.0  # process scheduling on a loaded 2-core box


def _worker(mode: str, out_dir: str) -> None:
    timeout = watchdog.timeout_from_minutes(TIMEOUT_MINUTES)
    dist.init_process_group("gloo")  # start-up on a loaded box may skew more than 6 s
    rank = dist.get_rank()
    config = presets.tiny_gpt2(num_layers=2, attention_dropout=0.0, hidden_dropout=0.0)
    torch.manual_seed(0)
    chunks = split_model(GPTModel(config), rank, 2)
    dist.barrier()
    watchdog.install(timeout, rank)  # from here on, every operation has the 6 s limit
    marker = Path(out_dir, f"rank{rank}.json")
    step = {"n": 0}

    def forward_step(chunk, inp, batch):
        if rank == 1 and step["n"] == 1:
            marker.write_text(json.dumps({"down_at": time.time()}))
            if mode == "die":
                sys.stdout.flush()
                import os

                os._exit(3)
            with watchdog.current().operation("all-reduce of gradients (simulated hang)"):
                time.sleep(120)
        return chunk(inp if inp is not None else batch[0], batch[2], None, batch[1])

    g = torch.Generator().manual_seed(1)
    with watchdog.exit_on_distributed_error():
        try:
            for step["n"] in range(4):
                batches = []
                for _ in range(4):
                    t = torch.randint(0, config.vocab_size, (2, 17), generator=g)
                    batches.append((t[:, :-1], t[:, 1:], torch.arange(16).expand(2, 16)))
                run_schedule(
                    build_schedule(4, rank, 2),
                    chunks,
                    batches,
                    forward_step=forward_step,
                    loss_func=lambda out, b: (out.mean() / 4, float(out.detach().mean())),
                    group=dist.group.WORLD,
                    tensor_shape=(2, 16, config.hidden_size),
                    dtype=torch.float32,
                    device=torch.device("cpu"),
                )
        finally:
            if rank == 0:
                marker.write_text(json.dumps({"down_at": time.time()}))
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["die", pytest.param("hang", marks=pytest.mark.slow)])
def test_one_failed_rank_ends_the_job_within_the_timeout(tmp_path: Path, mode: str) -> None:
    outcomes = run_ranks(__file__, 2, [mode, str(tmp_path)], timeout=180)
    markers = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(m.is_file() for m in markers), "\n---\n".join(o.log[-2000:] for o in outcomes)
    down = [json.loads(m.read_text())["down_at"] for m in markers]
    assert outcomes[0].returncode == 1, outcomes[0].log
    log = outcomes[0].log
    assert "rank 0" in log and "pipeline stage 0 of 2" in log, log
    assert "receive output gradient of micro-batch" in log, log
    assert "Traceback" not in log, log
    # rank 0 went down within the timeout of rank 1 going down
    assert down[0] - down[1] < TIMEOUT_MINUTES * 60 + SLACK_S
    if mode == "die":
        assert outcomes[1].returncode == 3
    else:
        assert outcomes[1].returncode == watchdog.HANG_EXIT_CODE, outcomes[1].log
        assert "rank 1: all-reduce of gradients (simulated hang) did not complete within" in (
            outcomes[1].log
        )
        assert "--distributed-timeout-minutes 0.2" in outcomes[1].log


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
