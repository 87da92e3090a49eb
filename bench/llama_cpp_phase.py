"""llama.cpp (through llama-cpp-python) beside mg-serve in bench_serve.py `--llama-cpp`.

The bench's own checkpoint is written as GGUF by mg-quantize's exporter: F32 and BF16 by
its GGUF writer on the float model (the weights mg-serve serves, as they are), Q8_0 by
`mg-quantize --recipe int8_wo --export-format gguf`, whose int8 checkpoint mg-serve serves
beside it (int8_wo is Q8_0 with every block of a row scaled by the row's scale: the same
weights on both sides). llama-cpp-python's `Llama` serves one sequence at a time, so both
sides are measured single-stream: llama.cpp takes each prompt in turn (`Llama.generate`
on the prompt's token ids, greedy, `--new-tokens` tokens; end-of-document does not stop
it) in a fresh process with n_threads = n_threads_batch = `--threads`. Tokens/s is the
generated tokens over the wall time, prompt processing included (mg-serve's through
HTTP streaming, llama.cpp's in process); decode-only tokens/s is the tokens after each
request's first over the time from its first to its last.

llama-cpp-python is a benchmark-only, optional dependency (it builds llama.cpp from its
sdist, several minutes): `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`.

    python bench/llama_cpp_phase.py MODEL.gguf PROMPTS.json NEW_TOKENS THREADS [--no-extra-buffers]
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TYPES = ("F32", "BF16", "Q8_0")
SKIPPED = (
    "llama.cpp: skipped (llama-cpp-python not installed: `pip install llama-cpp-python` "
    "builds it from source)"
)
NO_EXTRA_BUFFERS = "--no-extra-buffers"


def installed() -> bool:
    """Whether llama_cpp can be imported (looked up only: the library loads in the child)."""
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class Pair:
    """A GGUF file for llama.cpp and what mg-serve serves beside it."""

    gguf: Path
    ckpt: Path
    serve_flags: list[str]
    label: str
    """mg-serve's precision, in words."""


def _script(name: str, module: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def prepare(kind: str, folder: Path, ckpt: Path) -> Pair:
    """Export the checkpoint `ckpt` to GGUF `kind` under `folder`."""
    if kind == "Q8_0":
        save = folder / "int8_wo"
        if not save.exists():
            subprocess.run(
                [*_script("mg-quantize", "mg.quantize_export.cli"), "--no-progress",
                 "--load", str(ckpt), "--save", str(save), "--recipe", "int8_wo",
                 "--export-format", "gguf"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
        return Pair(save / "gguf" / "model-Q8_0.gguf", save, ["--bf16"], "int8_wo, bf16 act.")
    from mg.quantize_export.gguf_export import write_gguf
    from mg.quantize_export.loading import load_source

    path = folder / f"model-{kind}.gguf"
    source = load_source(ckpt)
    write_gguf(path, source.model.float(), source.config, source.tokenizer_config, ckpt, kind)
    if kind == "F32":
        return Pair(path, ckpt, [], "fp32")
    if kind == "BF16":
        return Pair(path, ckpt, ["--bf16"], "bf16")
    raise ValueError(f"GGUF type {kind!r}: the bench writes {', '.join(TYPES)}")


def measure(gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> dict:
    """llama.cpp on `prompts`, one after another, in a fresh process. Should it crash
    (SIGSEGV or SIGILL: llama.cpp's AMX matmul does on this model's Q8_0 prompts on an AMX
    CPU), once more with its extra weight buffers (AMX, repacked weights) off, and a note
    saying so."""
    prompts_file = gguf.with_suffix(".prompts.json")
    prompts_file.write_text(json.dumps(prompts))
    command = [sys.executable, __file__, str(gguf), str(prompts_file), str(new_tokens)]
    command.append(str(threads))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    child = subprocess.run(command, capture_output=True, text=True, env=env)
    note = None
    if child.returncode in (-signal.SIGSEGV, -signal.SIGILL):
        crash = signal.Signals(-child.returncode).name
        note = f"default buffers crashed ({crash}); use_extra_bufts off (no AMX/repacked weights)"
        child = subprocess.run(
            [*command, NO_EXTRA_BUFFERS], capture_output=True, text=True, env=env
        )
    if child.returncode != 0:
        sys.exit(f"llama.cpp failed ({child.returncode}):\n{child.stderr[-3000:]}")
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "note": note}


def decode_tps(result: dict) -> float:
    """Tokens after each request's first over the time from its first to its last (the
    inter-token gaps of a request add up to that time). mg-serve's times are its streamed
    chunks' arrivals at the client (chunks can arrive together), so with few new tokens its
    figure is rough."""
    gaps = sum(result["itl"])
    return (result["tokens"] - len(result["ttft"])) / gaps if gaps else float("nan")


def run(
    gguf: str, prompts: list[list[int]], new_tokens: int, threads: int, extra_buffers: bool
) -> dict:
    """The child: load the GGUF file, warm up, generate from each prompt in turn."""
    import llama_cpp
    import llama_cpp.llama_cpp as api

    if not extra_buffers:  # `Llama` takes no flag for it: its model defaults, changed
        defaults = api.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        api.llama_model_default_params = without_extra_buffers
    llm = llama_cpp.Llama(
        model_path=gguf,
        n_ctx=max(map(len, prompts)) + new_tokens + 8,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    used = (llm.context_params.n_threads, llm.context_params.n_threads_batch)
    if used != (threads, threads):
        raise SystemExit(f"llama.cpp took {used} threads (decode, batch), not {threads}")

    def one(prompt: list[int], tokens: int) -> tuple[float, list[float]]:
        llm.reset()  # no prefix of the previous request is reused
        started, arrivals = time.monotonic(), []
        for _ in llm.generate(prompt, temp=0.0):
            arrivals.append(time.monotonic())
            if len(arrivals) == tokens:
                break
        return started, arrivals

    one(prompts[0], 4)  # warm-up
    ttft, itl, elapsed, tokens = [], [], 0.0, 0
    for prompt in prompts:
        started, arrivals = one(prompt, new_tokens)
        ttft.append(arrivals[0] - started)
        itl += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        elapsed += arrivals[-1] - started
        tokens += len(arrivals)
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next((int(x.split()[1]) / 1024 for x in status if x.startswith("VmHWM:")), None)
    return {
        "tokens": tokens,
        "elapsed": elapsed,
        "ttft": ttft,
        "itl": itl,
        "peak_mb": peak if peak is not None else float("nan"),
        "threads": threads,
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


if __name__ == "__main__":
    gguf_path, prompts_path, new, n_threads = sys.argv[1:5]
    prompt_list = json.loads(Path(prompts_path).read_text())
    extra = NO_EXTRA_BUFFERS not in sys.argv[5:]
    print(json.dumps(run(gguf_path, prompt_list, int(new), int(n_threads), extra)))
