"""`mg-serve`: serve a checkpoint over HTTP, or talk to a server.

    mg-serve --load ckpt --port 5000          # Megatron's PUT /api + OpenAI /v1/completions
    mg-serve cli localhost:5000               # Megatron's interactive client
    torchrun --nproc-per-node 2 --no-python mg-serve --load ckpt   # tensor-parallel 2

The checkpoint describes its own model and tokenizer, so no model flags are
needed. Flag names follow Megatron-LM (`--load`, `--port`,
`--inference-max-requests`, `--inference-max-seq-length`,
`--max-tokens-to-oom`, `--bf16`) and, for the engine's knobs Megatron has no
flag for, vLLM (`--max-num-batched-tokens`, `--enable-prefix-caching`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from mg.core.help_format import DefaultsHelpFormatter
from mg.generate_server import cpu_isa
from mg.generate_server.client import run_client
from mg.generate_server.errors import ServeSetupError
from mg.generate_server.memory_size import parse_memory
from mg.generate_server.retro_flags import add_retro_flags
from mg.generate_server.startup_log import StartupLog, quiet_progress_bars_in_logs

log = logging.getLogger("mg.generate_server")


def _ckpt_step(value: str) -> int | str:
    if value == "release" or (value.isdigit() and value.isascii()):
        return value if value == "release" else int(value)
    raise argparse.ArgumentTypeError(f"expected an iteration number or 'release', got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mg-serve",
        description="Serve a checkpoint: Megatron's PUT /api, OpenAI-compatible /v1/completions "
        "(and /v1/chat/completions with a chat template), /health, /metrics, /docs. "
        "`mg-serve cli HOST:PORT` is the interactive client.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--load", required=True, help="checkpoint folder (mg-train/mg-convert)")
    parser.add_argument(
        "--ckpt-step",
        "--iteration",
        dest="ckpt_step",
        type=_ckpt_step,
        default=None,
        metavar="N",
        help="iteration to load, an int or 'release' (Megatron's name; --iteration is an "
        "alias). Default: latest_checkpointed_iteration.txt",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=5000, help="port (0: any free port)")
    parser.add_argument(
        "--inference-max-requests",
        type=int,
        default=8,
        help="sequences decoded together; more requests wait their turn",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV-cache pool: bytes (2GiB, 512MiB, 1.5GB, 1000000) or a fraction of the "
        "device's free memory (0.5). Default: room for --inference-max-requests sequences of "
        "--inference-max-seq-length, at most half the free memory (on the CPU only the blocks "
        "written take memory)",
    )
    parser.add_argument(
        "--kv-cache-block-size", type=int, default=16, help="positions per KV-cache block"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8", "fp8_e4m3"),
        default="auto",
        help="auto: the model's dtype; fp8 (= fp8_e4m3): keys and values stored as float8 "
        "e4m3 with an fp32 scale per position and head (about 1/4 of fp32's memory; "
        "refused where torch has no float8 on the device)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens one engine step runs: decodes first, then prompt chunks (chunked prefill); "
        "smaller keeps other requests' inter-token latency low while a long prompt is read",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the cached blocks of a prompt prefix seen before (e.g. a system prompt). "
        "Default: on, except for models with Mamba layers, whose recurrent state cached "
        "blocks cannot restore (refused there)",
    )
    parser.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        help="replay decode steps as CUDA graphs, one per batch-size bucket (GPU, dense "
        "GPT-family models, one process); steps with prompt chunks run eagerly",
    )
    parser.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="CPU: compile decode steps with torch.compile (inductor), one graph per "
        "batch-size bucket, at start-up before the server listens (minutes on a small CPU; "
        "dense GPT-family models, one process; needs a C++ compiler); steps with prompt "
        "chunks run eagerly, and every step does if compiling fails (logged). The start-up "
        "line says which runs",
    )
    parser.add_argument(
        "--draft-load",
        default=None,
        help="speculative decoding: a smaller checkpoint with the same tokenizer proposes "
        "tokens that the served model checks in one step; greedy requests only, their output "
        "unchanged (not with tensor parallelism or Mamba layers)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft tokens checked per step with --draft-load (default 4); without "
        "--draft-load, the served model's own multi-token prediction layer drafts one token "
        "a step (Megatron's --num-speculative-tokens; give 1)",
    )
    parser.add_argument(
        "--cpu-isa",
        choices=cpu_isa.CHOICES,
        default=os.environ.get(cpu_isa.ENVIRONMENT) or "auto",
        help="vector instructions the CPU kernels may use: auto (the best this CPU has), or "
        "amx, avx512, avx2 (that set and below: another machine's code path, refused where "
        f"this CPU lacks it), none (PyTorch's ops); also ${cpu_isa.ENVIRONMENT}",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads for the model (default: the cores this process may use, divided "
        "among the ranks on this machine)",
    )
    parser.add_argument(
        "--inference-max-seq-length",
        type=int,
        default=None,
        help="prompt + generation per sequence (default: the model's max positions)",
    )
    parser.add_argument(
        "--max-tokens-to-oom",
        type=int,
        default=12000,
        help="largest request: prompts x (longest prompt + tokens to generate)",
    )
    parser.add_argument(
        "--max-tokens-to-generate", type=int, default=None, help="cap on tokens per completion"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="largest request body"
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="a vision-language model's largest image (width x height); larger ones get a 400",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a request body; a slower client gets a 408",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued for the engine; past that a request is answered 503 with "
        "Retry-After (before any stream starts)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds before a request is cancelled"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MG_SERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $MG_SERVE_API_KEY; none: open)",
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="serve in bfloat16")
    precision.add_argument("--fp16", action="store_true", help="serve in float16 (GPU)")
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1 (default: cuda if any; under torchrun cuda:LOCAL_RANK or cpu)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=("flash", "fused", "unfused", "local", "auto"),
        default="auto",
        help="attention kernel, Megatron's names: flash (steps with a cache mask take the "
        "memory-efficient kernel), fused (cuDNN/memory-efficient), unfused/local (math), auto "
        "(PyTorch chooses); flash and fused need CUDA",
    )
    parser.add_argument(
        "--use-flash-attn", action="store_true", help="the same as --attention-backend flash"
    )
    parser.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=None,
        help="tensor-parallel ranks; launch that many with torchrun (default: WORLD_SIZE). "
        "Any checkpoint layout is resharded on load",
    )
    parser.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="under torchrun: a collective that takes longer ends the job",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    add_retro_flags(parser)
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in (
        "inference_max_requests",
        "max_tokens_to_oom",
        "max_request_bytes",
        "max_image_pixels",
        "kv_cache_block_size",
        "max_num_batched_tokens",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_waiting_requests < 1:  # every request passes through the queue
        parser.error("--max-waiting-requests must be >= 1 (0 would refuse every request)")
    if args.inference_max_seq_length is not None and args.inference_max_seq_length < 2:
        parser.error("--inference-max-seq-length must be >= 2")
    if args.max_tokens_to_generate is not None and args.max_tokens_to_generate < 0:
        parser.error("--max-tokens-to-generate must be >= 0")
    if args.request_timeout <= 0:
        parser.error("--request-timeout must be > 0 seconds")
    if args.request_body_timeout <= 0:
        parser.error("--request-body-timeout must be > 0 seconds")
    if args.distributed_timeout_minutes <= 0:
        parser.error("--distributed-timeout-minutes must be > 0")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be within 0..65535")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        parser.error("--num-speculative-tokens must be >= 1")
    if args.enable_torch_compile and args.enable_cuda_graph:
        parser.error(
            "--enable-torch-compile and --enable-cuda-graph: pick one (a CPU compiles the "
            "decode step, a GPU replays CUDA graphs)"
        )
    if args.num_threads is not None and args.num_threads < 1:
        parser.error("--num-threads must be >= 1")
    try:
        cpu_isa.check(args.cpu_isa)
    except cpu_isa.CpuIsaError as err:
        parser.error(str(err))
    os.environ[cpu_isa.ENVIRONMENT] = args.cpu_isa  # read where each kernel is built
    if args.api_key is not None and not args.api_key.strip():
        parser.error(
            "--api-key (or $MG_SERVE_API_KEY) is empty: give a token, or leave both unset "
            "for a server without authentication"
        )
    if args.kv_cache_memory is not None:
        try:
            parse_memory(args.kv_cache_memory)
        except ValueError as err:
            parser.error(f"--kv-cache-memory: {err}")


def _attention_backend(args: argparse.Namespace, device) -> str:
    """--attention-backend (or --use-flash-attn), refused in one line where it cannot run."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.core.models.attention_backend import BackendUnavailableError, check_attention_backend

    if args.use_flash_attn and args.attention_backend not in ("auto", "flash"):
        raise ServeSetupError(
            f"--use-flash-attn contradicts --attention-backend {args.attention_backend}"
        )
    backend = "flash" if args.use_flash_attn else args.attention_backend
    try:
        check_attention_backend(backend, device)
    except BackendUnavailableError as err:
        raise ServeSetupError(str(err)) from None
    return backend


def _check_fp8(device) -> None:
    """--kv-cache-dtype fp8 needs float8_e4m3fn in this torch, on this device."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.core.models.paged_kv_cache import Fp8UnavailableError, check_fp8

    try:
        check_fp8(device)
    except Fp8UnavailableError as err:
        raise ServeSetupError(f"--kv-cache-dtype fp8: {err}") from None


def serve(args: argparse.Namespace, steps: StartupLog | None = None) -> None:
    """One process, or one rank of `torchrun --nproc-per-node T` (rank 0 serves HTTP);
    `steps` logs each loading step as it begins."""
    steps = steps or StartupLog()
    steps.step("importing torch and the serving code")
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    import torch
    import torch.distributed as dist

    # lazy, as torch: each of these imports it
    from mg.core.models.core_attention import set_attention_backend
    from mg.core.models.mamba import MambaModel
    from mg.generate_server.loading import load_for_serving
    from mg.generate_server.packed_linears import pack_linears, weight_packing
    from mg.generate_server.resources import (
        check_cpu_bf16,
        pool_blocks,
        release_freed_heap,
        set_threads,
    )
    from mg.generate_server.retro_serving import (
        RetroRunner,
        is_retro_checkpoint,
        load_retro_for_serving,
        retro_max_length,
    )
    from mg.generate_server.runner import GATHERED, ModelRunner
    from mg.generate_server.tensor_parallel import (
        TensorParallelRunner,
        init_tensor_parallel,
        resolve_tensor_parallel_size,
        run_worker,
        serving_device,
    )

    tp = resolve_tensor_parallel_size(args.tensor_model_parallel_size)
    device = serving_device(args.device, tp)
    threads = set_threads(args.num_threads, device)
    if device.type == "cpu" and tp == 1:
        # one process: the model runs in the engine thread, which sets `threads` for itself.
        # This thread stays at 1, so that it never starts an OpenMP team of its own: with a
        # second team libgomp stops spin-waiting (more threads than cores), and every
        # parallel region of the engine's step waits on a sleeping worker (1.5x the step)
        torch.set_num_threads(1)
    if args.bf16 and device.type == "cpu":
        check_cpu_bf16()
    backend = _attention_backend(args, device)
    kv_cache_dtype = "fp8" if args.kv_cache_dtype.startswith("fp8") else "auto"
    if kv_cache_dtype == "fp8":
        _check_fp8(device)
    env = init_tensor_parallel(tp, device, args.distributed_timeout_minutes)
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
    if is_retro_checkpoint(args.load, args.ckpt_step):  # recomputed each step, with retrieval
        steps.step("reading the Retro checkpoint %s and its retrieval project", args.load)
        loaded = load_retro_for_serving(args, device, dtype)
        max_length = retro_max_length(args, loaded)
        runner = RetroRunner(
            loaded.model, loaded.retriever, args.inference_max_requests, max_length
        )
        runner.num_threads = threads
        _serve_http(args, loaded, runner, max_length, 1, None, steps)
        return
    which = "latest iteration" if args.ckpt_step is None else f"iteration {args.ckpt_step}"
    steps.step("reading checkpoint %s (%s) and building its model on %s", args.load, which, device)
    loaded = load_for_serving(
        args.load, device=str(device), dtype=dtype, iteration=args.ckpt_step, layout=env.layout
    )
    parameters = sum(p.numel() for p in loaded.model.parameters())
    steps.step("model built: %s, %s parameters", type(loaded.model).__name__, f"{parameters:,}")
    set_attention_backend(loaded.model, backend, loaded.config)
    if args.enable_prefix_caching and isinstance(loaded.model, MambaModel):
        raise ServeSetupError(
            "--enable-prefix-caching: this model's Mamba layers keep a recurrent state that "
            "cached prompt blocks cannot restore; serve it without the flag (off for this model)"
        )
    positions = loaded.config.max_position_embeddings
    max_length = min(args.inference_max_seq_length or positions, positions)
    num_blocks = pool_blocks(
        loaded.model,
        device,
        args.kv_cache_memory,
        args.kv_cache_block_size,
        args.inference_max_requests,
        max_length,
        fp8=kv_cache_dtype == "fp8",
    )
    if dist.is_initialized():  # every rank must offer rank 0's engine the same pool
        agreed = torch.tensor([num_blocks], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        num_blocks = int(agreed)
    pool = (num_blocks, args.kv_cache_block_size, kv_cache_dtype)
    steps.step(
        "setting up the KV cache (%d blocks of %d positions)", num_blocks, args.kv_cache_block_size
    )
    if args.enable_cuda_graph:
        runner = _graph_runner(args, loaded, device, tp, max_length, pool)
    elif args.enable_torch_compile:
        runner = _compiled_runner(args, loaded, device, tp, max_length, pool)
        if weight_packing() == "AMX":  # the graphs call the kernel; else inductor packs
            runner.packed_linears = pack_linears(loaded.model)
    elif env.tp_mesh is None:
        runner = ModelRunner(loaded.model, args.inference_max_requests, max_length, *pool)
    else:
        runner = TensorParallelRunner(
            loaded.model, args.inference_max_requests, max_length, env, *pool
        )
    runner.num_threads = threads
    runner.attention_backend = backend
    steps.step("choosing decode attention (a C++ kernel is built once, then cached)")
    decode_attention = runner.choose_decode_attention()
    if runner.cache_decode_kernel is None and decode_attention != GATHERED:
        log.warning("decode attention: %s", decode_attention)  # why the kernel is not used
    if type(runner) is ModelRunner and device.type == "cpu":
        steps.step("preparing CPU kernels (packed weights, fused decode steps)")
        _pack_and_fuse(runner)
    drafter = None
    if args.draft_load is not None:
        steps.step("reading the draft model %s", args.draft_load)
        drafter = _drafter(args, loaded, runner, device, dtype, tp)
    elif args.num_speculative_tokens is not None:
        steps.step("drafting with the model's multi-token prediction layer")
        drafter = _mtp_drafter(args, loaded, runner)
    if args.enable_torch_compile:
        steps.step("compiling decode steps with torch.compile (minutes on a small CPU)")
        runner.compile_buckets()  # before the server listens: no request pays it
    if device.type == "cpu":
        release_freed_heap()
    if env.is_driver:
        steps.step("starting the engine and the HTTP server")
        _serve_http(args, loaded, runner, max_length, tp, drafter, steps)
    else:
        run_worker(runner)
    if dist.is_initialized():
        dist.destroy_process_group()


def _pack_and_fuse(runner) -> None:
    """The eager CPU runner: its bf16 linears packed once (`packed_linears`) and, with
    `--attention-backend auto`, every step one C++ call where the model and `--cpu-isa`
    allow it (`fused_decode` with AMX, `vector_decode` on AVX2/AVX-512), logged in one
    line: "decode steps fused: avx2 fp32", or why not."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.generate_server.packed_linears import pack_linears, weight_packing
    from mg.generate_server.vector_decode import vector_decode_unsupported

    fused = runner.attention_backend == "auto"
    # oneDNN's packed layout cannot be read back: where the vector step takes the model
    # (no AMX here, or not allowed), its weights stay as they are for it
    vector_step = weight_packing() != "AMX" and (
        vector_decode_unsupported(runner.model, runner.cache) is None
    )
    if not (fused and vector_step):
        runner.packed_linears = pack_linears(runner.model)
    if not fused:
        log.info("decode steps op by op: --attention-backend %s", runner.attention_backend)
        return
    why = runner.use_fused_decode()
    if why is None:
        log.info("decode steps fused: %s", runner.fused_decode.description)
    else:
        log.info("decode steps op by op: %s", why)


def _graph_runner(args: argparse.Namespace, loaded, device, tp: int, max_length: int, pool):
    """--enable-cuda-graph: the runner that replays decode steps, where it can."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.generate_server.cuda_graphs import CudaGraphRunner

    if device.type != "cuda":
        raise ServeSetupError("--enable-cuda-graph needs a CUDA device; this one is " + device.type)
    if tp > 1:
        raise ServeSetupError("--enable-cuda-graph does not work with tensor parallelism yet")
    try:
        return CudaGraphRunner(loaded.model, args.inference_max_requests, max_length, *pool)
    except ValueError as err:
        raise ServeSetupError(f"--enable-cuda-graph: {err}") from None


def _compiled_runner(args: argparse.Namespace, loaded, device, tp: int, max_length: int, pool):
    """--enable-torch-compile: the runner whose decode steps run compiled graphs."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.generate_server.compiled_decode import CompiledDecodeRunner

    if device.type != "cpu":
        raise ServeSetupError(
            f"--enable-torch-compile compiles decode steps for a CPU; on {device.type} use "
            "--enable-cuda-graph"
        )
    if tp > 1:
        raise ServeSetupError("--enable-torch-compile does not work with tensor parallelism yet")
    try:
        return CompiledDecodeRunner(loaded.model, args.inference_max_requests, max_length, *pool)
    except ValueError as err:
        raise ServeSetupError(f"--enable-torch-compile: {err}") from None


def _mtp_drafter(args: argparse.Namespace, loaded, runner):
    """--num-speculative-tokens without --draft-load: the served model's first MTP depth
    drafts one token a step (mtp_draft.py); its decoder runs op by op for the hidden states."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.generate_server.mtp_draft import MTPDrafter
    from mg.generate_server.runner import ModelRunner

    if getattr(loaded.model, "mtp", None) is None:
        raise ServeSetupError(
            f"--num-speculative-tokens without --draft-load drafts with the model's "
            f"multi-token prediction layers, and {args.load} has none; give --draft-load"
        )
    if args.num_speculative_tokens != 1:
        raise ServeSetupError(
            f"--num-speculative-tokens {args.num_speculative_tokens}: the MTP layer drafts one "
            "token a step; give --num-speculative-tokens 1 (or a --draft-load model)"
        )
    if type(runner) is not ModelRunner:
        raise ServeSetupError(
            "--num-speculative-tokens with the model's MTP layer needs the op-by-op decode "
            "(one process, no --enable-cuda-graph or --enable-torch-compile)"
        )
    if runner.fused_decode is not None:
        log.info("decode steps op by op: the MTP draft reads the decoder's hidden states")
        runner.fused_decode = None
    return MTPDrafter(
        runner,
        vocab_size=min(loaded.tokenizer.vocab_size, loaded.config.vocab_size),
        catch_up_tokens=args.max_num_batched_tokens,
    )


def _drafter(args: argparse.Namespace, loaded, runner, device, dtype: str | None, tp: int):
    """--draft-load: the draft model over a pool of the target's blocks, checked to share
    its tokenizer, to reach its positions and to be able to roll back."""
    # lazy: torch and the serving code only once the flags are good (--help stays instant)
    from mg.core.models.mamba import MambaModel
    from mg.generate_server.loading import load_for_serving
    from mg.generate_server.runner import ModelRunner
    from mg.generate_server.speculative import Drafter

    if tp > 1:
        raise ServeSetupError("--draft-load does not work with tensor parallelism yet")
    if runner.recurrent_state:
        raise ServeSetupError(
            "--draft-load: the served model's Mamba layers cannot roll back rejected draft "
            "tokens; serve it without a draft model"
        )
    draft = load_for_serving(args.draft_load, device=str(device), dtype=dtype)
    if isinstance(draft.model, MambaModel):
        raise ServeSetupError(
            f"--draft-load {args.draft_load}: a draft model with Mamba layers cannot roll back "
            "rejected tokens; use a GPT-family draft"
        )
    probe = "The quick brown fox jumps over the lazy dog. 0123456789"
    if draft.tokenizer.vocab_size != loaded.tokenizer.vocab_size or draft.tokenizer.tokenize(
        probe
    ) != loaded.tokenizer.tokenize(probe):
        raise ServeSetupError(
            f"--draft-load {args.draft_load}: its tokenizer differs from the served model's "
            f"({draft.tokenizer.vocab_size} vs {loaded.tokenizer.vocab_size} tokens); a draft "
            "model must share the tokenizer"
        )
    if draft.config.max_position_embeddings < runner.max_length:
        raise ServeSetupError(
            f"--draft-load {args.draft_load}: it has {draft.config.max_position_embeddings} "
            f"positions, fewer than the {runner.max_length} served; lower "
            "--inference-max-seq-length"
        )
    draft_runner = ModelRunner(
        draft.model,
        runner.num_slots,
        runner.max_length,
        runner.num_blocks,
        runner.block_size,
        runner.kv_cache_dtype,
    )
    draft_runner.attention_backend = runner.attention_backend
    draft_runner.choose_decode_attention()
    if type(runner) is ModelRunner and device.type == "cpu":  # as the served model's
        _pack_and_fuse(draft_runner)
    return Drafter(
        draft_runner,
        num_tokens=args.num_speculative_tokens or 4,
        vocab_size=min(loaded.tokenizer.vocab_size, loaded.config.vocab_size),
        catch_up_tokens=args.max_num_batched_tokens,
    )


def _serve_http(
    args: argparse.Namespace,
    loaded,
    runner,
    max_length: int,
    tp: int,
    drafter=None,
    steps: StartupLog | None = None,
) -> None:
    """Rank 0: the engine over `runner`, the app, and uvicorn until SIGINT/SIGTERM."""
    # lazy: the web server and the engine only once the flags are good (--help stays instant)
    import uvicorn

    # lazy, as uvicorn: the app and the engine import torch and fastapi
    from mg.generate_server.app import ServerSettings, create_app
    from mg.generate_server.chat import load_chat_template
    from mg.generate_server.engine import GenerationEngine
    from mg.generate_server.megatron_api import Limits
    from mg.generate_server.packed_linears import weight_packing

    engine = None
    try:
        engine = GenerationEngine(
            runner,
            loaded.tokenizer.detokenize,
            vocab_size=min(loaded.tokenizer.vocab_size, loaded.config.vocab_size),
            max_waiting=args.max_waiting_requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefix_caching=args.enable_prefix_caching,
            drafter=drafter,
        )
        settings = ServerSettings(
            limits=Limits(max_length, args.max_tokens_to_oom, args.max_tokens_to_generate),
            max_request_bytes=args.max_request_bytes,
            request_body_timeout=args.request_body_timeout,
            request_timeout=args.request_timeout,
            api_key=args.api_key,
            vision=_vision(loaded, args.max_image_pixels),
        )
        chat = load_chat_template(loaded.tokenizer_config)
        app = create_app(engine, loaded.tokenizer, loaded.name, settings, chat)
        sock = _listen(args.host, args.port)
        port = sock.getsockname()[1]
        endpoints = "PUT /api, POST /v1/completions" + (", /v1/chat/completions" if chat else "")
        layout = f"tensor-parallel {tp} x {runner.device.type}" if tp > 1 else runner.device.type
        if runner.cache_decode_kernel is not None:
            layout += ", decode attention in place"
        if runner.packed_linears:
            layout += f", {weight_packing()}-packed weights"
        if runner.fused_decode is not None:
            layout += f", decode steps fused ({runner.fused_decode.description})"
        if args.enable_torch_compile:
            layout += ", " + runner.status
        if args.enable_cuda_graph:
            layout += ", decode steps as CUDA graphs"
        if runner.recurrent_state:
            layout += ", " + getattr(
                runner, "description", "Mamba state per sequence, no prefix caching"
            )
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        threads = f", {runner.num_threads} threads" if runner.device.type == "cpu" else ""
        pool = runner.num_blocks * runner.block_size
        kv_dtype = ", fp8" if runner.kv_cache_dtype == "fp8" else ""
        if drafter is not None:  # a draft model, or the served model's MTP layer
            draft = Path(args.draft_load).name if args.draft_load else "its MTP layer"
            kv_dtype += f", draft {draft} x {drafter.num_tokens} tokens"
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        with _stop_on_signals(server):
            print(
                f"mg-serve: {loaded.name} ({layout}, {dtype}{threads}, {max_length} positions, "
                f"{args.inference_max_requests} sequences, KV cache {runner.num_blocks} blocks x "
                f"{runner.block_size} = {pool} positions{kv_dtype}) "
                f"listening on http://{args.host}:{port} "
                f"[{endpoints}, GET /health, /metrics, /docs]"
                + (f" after {steps.elapsed():.1f} s of start-up" if steps is not None else ""),
                flush=True,
            )
            server.run(sockets=[sock])
    finally:
        if engine is not None:
            engine.shutdown()  # its thread closes the runner (the other ranks stop)
        else:
            runner.close()


@contextlib.contextmanager
def _stop_on_signals(server) -> Iterator[None]:
    """SIGINT/SIGTERM stop `server` gracefully from the moment "listening on" is printed.

    uvicorn installs its own handlers only once `run` has started its loop, and when done
    re-raises the signal to the handler installed before it. Ours asks the server to exit,
    so a signal that comes before uvicorn's handlers (a slow start) is not lost, and one
    uvicorn re-raises makes `run` return: the engine (and, under torchrun, the other ranks)
    is shut down, exit status 0."""

    def stop(*_) -> None:
        server.should_exit = True

    stopping = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, stop) for sig in stopping}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # clients that connect before uvicorn starts wait in the backlog
    except OSError as err:
        raise ServeSetupError(f"cannot listen on {host}:{port}: {err}") from None
    return sock


def _check_load_folders(args: argparse.Namespace) -> None:
    """--load and --draft-load, checked before torch is imported (seconds on a slow machine):
    a folder that is not there, or a Hugging Face folder given as a checkpoint, named with
    how to convert it (loading would only find no latest_checkpointed_iteration.txt)."""
    for flag, value in (("--load", args.load), ("--draft-load", args.draft_load)):
        if value is not None and not Path(value).is_dir():
            what = "is a file, not a folder" if Path(value).exists() else "does not exist"
            raise ServeSetupError(
                f"{flag} {value} {what}; give the checkpoint folder mg-train --save or "
                "mg-convert wrote"
            )
        if value is not None and _is_hugging_face_folder(Path(value)):
            raise ServeSetupError(
                f"{flag} {value} is a Hugging Face folder (config.json + weights), not an mg "
                f"checkpoint; convert it first: mg-convert import-hf {value} --save <ckpt>, "
                f"then {flag} <ckpt>"
            )


def _is_hugging_face_folder(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    if (folder / "latest_checkpointed_iteration.txt").exists() or any(folder.glob("iter_*")):
        return False  # an mg / Megatron checkpoint (that happens to hold a config.json)
    weights = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
    return any(any(folder.glob(pattern)) for pattern in weights)


def main(argv: Sequence[str] | None = None) -> None:
    steps = StartupLog()
    quiet_progress_bars_in_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cli":
        client = argparse.ArgumentParser(
            prog="mg-serve cli", description="Interactive client of a running mg-serve."
        )
        client.add_argument("address", help="HOST:PORT of the server")
        client.add_argument("--api-key", default=None, help="bearer token (or $MG_SERVE_API_KEY)")
        options = client.parse_args(argv[1:])
        sys.exit(run_client(options.address, options.api_key))
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        _check_load_folders(args)
        serve(args, steps)
    except ServeSetupError as err:
        print(f"mg-serve: error: {err}", file=sys.stderr)
        sys.exit(2)


def _vision(loaded, max_image_pixels: int):
    """A vision-language checkpoint's image path (None for a text-only model)."""
    if loaded.vlm is None:
        return None
    from mg.generate_server.vision_prefill import VisionPrefill  # lazy: torch and the model

    return VisionPrefill(loaded.vlm, max_image_pixels)


if __name__ == "__main__":
    main()
