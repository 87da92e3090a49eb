"""Tensor-parallel serving under torchrun: rank 0 serves HTTP and drives, every rank computes.

    torchrun --nproc-per-node 2 -m mg.generate_server.cli --load ckpt --port 5000

Every rank reads only its tensor-parallel shard of each layer (heads, MLP
columns, vocabulary rows) from the checkpoint, whatever layout it was saved in
(core's `load_model_part`); the KV cache then holds this rank's heads only.
Rank 0's engine decides each step; `TensorParallelRunner.forward` broadcasts
the step (a 4-number header, then token ids, positions, the rows whose logits
are needed and the step's segments with their block tables) and all ranks run
the same forward over their own paged KV cache, whose vocab-parallel output is gathered so rank 0
samples from the full logits. The other ranks sit in `run_worker`, answering
steps until rank 0 broadcasts shutdown.

Failure handling: a broadcast or forward that fails for a communication
reason ends the process at once (torchrun then stops the job); while idle,
rank 0 sends a heartbeat often enough that the others' wait never reaches
`--distributed-timeout-minutes`, and a dead peer is noticed then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from mg.core.models import GPTModel
from mg.core.models.paged_kv_cache import PagedSegment, decode_segments, encode_segments
from mg.core.parallel import watchdog
from mg.core.parallel.layout import ParallelLayout, build_parallel_layout
from mg.core.parallel.mesh import ParallelLayoutError
from mg.generate_server.errors import ServeSetupError
from mg.generate_server.runner import DEFAULT_BLOCK_SIZE, ModelRunner

log = logging.getLogger("mg.generate_server")

FORWARD, HEARTBEAT, SHUTDOWN = 1, 2, 3
"""Opcodes of the step header [op, tokens, logit rows, segment ints] that rank 0 broadcasts."""


@dataclass
class TensorParallelEnv:
    """This process's place in a torchrun job, once its process group is up."""

    layout: ParallelLayout
    device: torch.device
    timeout_minutes: float

    @property
    def rank(self) -> int:
        return self.layout.tp_rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.layout.tp_mesh

    @property
    def is_driver(self) -> bool:
        """Rank 0: serves HTTP, runs the engine, samples."""
        return self.rank == 0


def resolve_tensor_parallel_size(requested: int | None) -> int:
    """The TP size: torchrun's WORLD_SIZE, which `--tensor-model-parallel-size` must equal."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = world if requested is None else requested
    if tp < 1:
        raise ServeSetupError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if tp != world:
        how = (
            f"launch it as torchrun --nproc-per-node {tp} mg-serve ..."
            if world == 1
            else f"drop the flag or launch {tp} processes"
        )
        raise ServeSetupError(
            f"--tensor-model-parallel-size {tp} needs {tp} processes but WORLD_SIZE is {world} "
            f"(mg-serve runs tensor parallelism only, no pipeline or data parallel ranks); {how}"
        )
    if world > 1:
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ServeSetupError(
                f"WORLD_SIZE={world} but {', '.join(missing)} is not set; start mg-serve with "
                f"torchrun --nproc-per-node {world} (it sets them)"
            )
    return tp


def serving_device(requested: str | None, world_size: int) -> torch.device:
    """One process: --device or cuda if any. Under torchrun: cuda:LOCAL_RANK, or cpu."""
    if world_size == 1:
        return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if requested not in (None, "cpu", "cuda"):
        raise ServeSetupError(
            f"--device {requested}: under torchrun each rank uses cuda:LOCAL_RANK; "
            "pass --device cuda or --device cpu"
        )
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_tensor_parallel(
    tp: int, device: torch.device, timeout_minutes: float
) -> TensorParallelEnv:
    """Join torchrun's process group (NCCL on GPU, gloo on CPU) and build the TP layout."""
    if tp == 1:
        return TensorParallelEnv(ParallelLayout(), device, timeout_minutes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = watchdog.timeout_from_minutes(timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
            timeout=timeout,
        )
    rank = dist.get_rank()
    watchdog.install(timeout, rank, where=f"tensor-parallel rank {rank} of {tp}")
    try:
        layout = build_parallel_layout(tp, rank, tp=tp, device_type=device.type)
    except ParallelLayoutError as err:
        raise ServeSetupError(str(err)) from None
    return TensorParallelEnv(layout, device, timeout_minutes)


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` over a TP-sharded model: rank 0 broadcasts every step it runs.

    Rank 0's engine thread is the only caller; the other ranks replay the same
    steps in `run_worker`, so collectives always happen in the same order.
    """

    def __init__(
        self,
        model: GPTModel,
        num_slots: int,
        max_length: int,
        env: TensorParallelEnv,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_dtype: str = "auto",
    ):
        super().__init__(model, num_slots, max_length, num_blocks, block_size, kv_cache_dtype)
        self.env = env
        self.group = env.tp_mesh.get_group()
        self.heartbeat_seconds = min(30.0, env.timeout_minutes * 60.0 / 4.0)
        self._closed = False

    def _broadcast(self, tensor: Tensor, what: str) -> Tensor:
        tensor = tensor.to(self.env.device)
        with watchdog.exit_on_distributed_error(), watchdog.current().operation(what):
            dist.broadcast(tensor, src=0, group=self.group)
        return tensor

    def _header(self, op: int, tokens: int = 0, rows: int = 0, segments: int = 0) -> Tensor:
        header = torch.tensor([op, tokens, rows, segments], dtype=torch.long)
        return self._broadcast(header, "step header")

    def forward(
        self,
        segments: Sequence[PagedSegment],
        input_ids: Sequence[int],
        positions: Sequence[int],
        logit_rows: Sequence[int],
    ) -> Tensor:
        flat = encode_segments(segments)
        self._header(FORWARD, len(input_ids), len(logit_rows), len(flat))
        step = torch.tensor([*input_ids, *positions, *logit_rows, *flat], dtype=torch.long)
        self._broadcast(step, "step inputs")
        return self.local_forward(segments, input_ids, positions, logit_rows)

    def local_forward(
        self,
        segments: Sequence[PagedSegment],
        input_ids: Sequence[int],
        positions: Sequence[int],
        logit_rows: Sequence[int],
    ) -> Tensor:
        """The forward every rank runs; a communication failure inside it ends the process."""
        with watchdog.exit_on_distributed_error(), _fatal_unless_input_error():
            return super().forward(segments, input_ids, positions, logit_rows)

    def heartbeat(self) -> None:
        if not self._closed:
            self._header(HEARTBEAT)

    def close(self) -> None:
        """Tell the other ranks to leave `run_worker` (once; a dead peer is not waited for)."""
        if self._closed:
            return
        self._closed = True
        try:
            with watchdog.current().operation("shutdown message"):
                dist.broadcast(
                    torch.tensor([SHUTDOWN, 0, 0, 0], device=self.env.device),
                    src=0,
                    group=self.group,
                )
        except watchdog.DistributedOperationError as err:
            log.warning("could not tell the other ranks to stop: %s", err)


@contextlib.contextmanager
def _fatal_unless_input_error() -> Iterator[None]:
    """Inside a TP forward, a ValueError (a bad step, raised identically on every rank) is
    the step's error; anything else may have left a collective half done: end the process."""
    try:
        yield
    except ValueError:
        raise
    except Exception as error:
        print(
            f"mg-serve: rank {dist.get_rank()}: tensor-parallel forward failed, ending the job: "
            f"{type(error).__name__}: {error}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def run_worker(runner: TensorParallelRunner) -> None:
    """A non-zero rank: replay rank 0's steps until it broadcasts shutdown.

    SIGINT is ignored (Ctrl-C reaches every rank; rank 0 stops the others with
    its shutdown message); SIGTERM keeps its default, immediate exit.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    header = torch.zeros(4, dtype=torch.long)
    while True:
        op, tokens, rows, flat = runner._broadcast(
            header, "waiting for rank 0's next step"
        ).tolist()
        if op == SHUTDOWN:
            runner._closed = True
            return
        if op == HEARTBEAT:
            continue
        size = 2 * tokens + rows + flat
        step = runner._broadcast(torch.zeros(size, dtype=torch.long), "step").tolist()
        ids, positions = step[:tokens], step[tokens : 2 * tokens]
        logit_rows, segments = step[2 * tokens : 2 * tokens + rows], step[2 * tokens + rows :]
        try:
            runner.local_forward(decode_segments(segments), ids, positions, logit_rows)
        except ValueError as err:  # rank 0 raised the same and fails that step's requests
            log.debug("step failed on every rank: %s", err)
