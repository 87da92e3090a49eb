"""Peak memory of `mg-convert import-hf` / `export-hf` against the model's size and
against a whole-model conversion, on a Llama-shaped checkpoint written in shards.

    uv run --frozen python bench/bench_convert_memory.py                  # ~1.4 GB fp32
    uv run --frozen python bench/bench_convert_memory.py --layers 6 --hidden 512   # quick

The Hugging Face folder (config.json, model-0000K-of-0000N.safetensors, index) is
made layer by layer with random weights, so making it does not need the memory
either; it is cached under bench/.work/. Each contender runs in its own process
and its peak RSS is the kernel's (getrusage of the child: ru_maxrss):

- baselines: the same imports alone, and the imports plus building the model on the
  meta device (a fixed ~115 MB of torch's lazily set-up kernels, whatever the model
  size); the converters are measured above the second, the reference above the first;
- mg-convert import-hf (one layer at a time, streamed into the checkpoint file);
- mg-convert export-hf of that checkpoint (`torch` format, memory-mapped, one layer
  at a time, each tensor written to its place in the safetensors file), and of the
  same checkpoint in `torch_dist` format (each layer's keys read through DCP; the
  conversion to torch_dist is set-up, not measured); export builds no model, so it
  is measured above the imports alone;
- whole-model reference: every shard loaded (`safetensors.torch.load_file`), mapped
  with the same table (`hf_to_megatron`) and `torch.save`d at once, which is what
  a converter that holds the model does.

Printed: model bytes, each peak RSS, the peak above the baseline, and both as a
ratio of the model size. Importing torch and friends peaks higher than the RSS it
leaves (~140 MB of transient memory), so "above base" (another process's peak
subtracted) can hide up to that much; "work peak" is exact: each child records its
RSS after the imports, resets the kernel's peak mark (Linux `clear_refs`) and
reports its peak RSS (VmHWM) above that start at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work" / "convert-memory"

IMPORTS = "import torch, safetensors.torch, mg.ckpt_convert.import_hf, mg.ckpt_convert.export_hf"
CONTENDERS = {
    "baseline (imports only)": f"{IMPORTS}",
    # the fixed start-up cost: imports, and the first model built on the meta
    # device (~115 MB of torch's lazily set-up kernels, whatever the model size)
    "baseline (start-up)": f"""{IMPORTS}
import json
from mg.ckpt_convert.import_hf import expected_shapes, model_config_from_hf
from pathlib import Path
expected_shapes(model_config_from_hf(json.load(open(SRC + "/config.json")), Path(SRC), 128))""",
    "mg-convert import-hf": f"""{IMPORTS}
from mg.ckpt_convert.import_hf import import_hf
import_hf(SRC, OUT, progress=False)""",
    "mg-convert export-hf": f"""{IMPORTS}
from mg.ckpt_convert.export_hf import export_hf
export_hf(CKPT, OUT, progress=False)""",
    "mg-convert export-hf (torch_dist)": f"""{IMPORTS}
from mg.ckpt_convert.export_hf import export_hf
export_hf(DIST, OUT, progress=False)""",
    "whole-model reference": f"""{IMPORTS}
import glob, json
from safetensors.torch import load_file
from mg.core.models.hf_mapping import config_from_hf, hf_to_megatron
state = {{}}
for f in sorted(glob.glob(SRC + "/*.safetensors")):
    state.update(load_file(f))
config = config_from_hf(json.load(open(SRC + "/config.json")))
torch.save({{"model": hf_to_megatron(state, config, "llama")}}, OUT + ".pt")""",
}
EXPORTS = ("mg-convert export-hf", "mg-convert export-hf (torch_dist)")
TO_TORCH_DIST = """from mg.ckpt_convert.format_convert import convert_format
convert_format(CKPT, DIST, "torch_dist", report=lambda _: None)"""


def make_llama(folder: Path, layers: int, hidden: int, ffn: int, vocab: int) -> int:
    """A random LlamaForCausalLM folder, one safetensors shard per layer; returns bytes."""
    import torch
    from safetensors.torch import save_file

    heads, kv_heads = max(hidden // 64, 1), max(hidden // 128, 1)
    head_dim = hidden // heads
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        torch_dtype="float32",
    )
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
                p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": rand(ffn, hidden),
                p + "mlp.up_proj.weight": rand(ffn, hidden),
                p + "mlp.down_proj.weight": rand(hidden, ffn),
            }
        )
    shards.append({"model.norm.weight": torch.ones(hidden), "lm_head.weight": rand(vocab, hidden)})
    folder.mkdir(parents=True)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        shards[k - 1] = {}  # written: let it go
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return total


# Run in each child between its imports (the first line of every contender) and its
# work: the RSS then, and the kernel's peak-RSS mark reset (Linux: clear_refs 5), so
# that VmHWM at the end is the peak of the work alone.
_MARK = """
def _status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
_rss_after_imports = _status("VmRSS")
try:
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    _rss_after_imports = None
"""
_REPORT = """
if _rss_after_imports is not None:
    print("work-peak-above-start", _status("VmHWM") - _rss_after_imports)
"""


def peak_rss(code: str, **paths: Path) -> tuple[int, float, int | None]:
    """Run `code` in a fresh interpreter: its peak RSS in bytes (ru_maxrss, imports
    included), its wall time, and the peak of the work above the RSS it started from."""
    prelude = "".join(f"{k} = {str(v)!r}\n" for k, v in paths.items())
    imports, _, work = code.partition("\n")
    child = prelude + imports + "\n" + _MARK + work + "\n" + _REPORT
    wrapper = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run([sys.executable, '-c', sys.argv[1]])\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(p.returncode)\n"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", wrapper, child], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"contender failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    above_start = None
    for line in lines:
        if line.startswith("work-peak-above-start "):
            above_start = int(line.split()[1])
    return int(lines[-1]) * 1024, elapsed, above_start  # ru_maxrss is KiB on Linux


def run(
    layers: int,
    hidden: int,
    ffn: int,
    vocab: int,
    work: Path = WORK,
    contenders: tuple[str, ...] = tuple(CONTENDERS),
) -> dict[str, dict]:
    """Peak RSS of each contender (and the baselines they are measured above)."""
    key = f"llama-l{layers}-h{hidden}-f{ffn}-v{vocab}"
    source = work / key
    if not (source / "config.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        make_llama(source, layers, hidden, ffn, vocab)
    model_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    ckpt, dist, whole = work / "ckpt", work / "ckpt-dist", work / "whole"
    exported = {name: work / f"exported-{k}" for k, name in enumerate(EXPORTS)}
    for path in (ckpt, dist, *exported.values()):
        shutil.rmtree(path, ignore_errors=True)
    Path(str(whole) + ".pt").unlink(missing_ok=True)
    results = {}
    wanted = set(contenders) | {"baseline (imports only)", "baseline (start-up)"}
    if wanted & set(EXPORTS):
        wanted.add("mg-convert import-hf")  # export reads what import wrote
    for name, code in CONTENDERS.items():
        if name not in wanted:
            continue
        if name == "mg-convert export-hf (torch_dist)":
            peak_rss(TO_TORCH_DIST, CKPT=ckpt, DIST=dist)  # set-up, not measured
        out = {"mg-convert import-hf": ckpt, **exported}.get(name, whole)
        rss, seconds, above_start = peak_rss(code, SRC=source, CKPT=ckpt, DIST=dist, OUT=out)
        results[name] = {"peak_rss": rss, "seconds": seconds, "above_start": above_start}
    # import-hf is measured above the start-up that includes the meta model it
    # builds; export-hf and the whole-model reference (no model built) above the imports
    for name, values in results.items():
        base = (
            "baseline (start-up)" if name == "mg-convert import-hf" else "baseline (imports only)"
        )
        if name == "baseline (imports only)" or base not in results:
            base = "baseline (imports only)"
        values["above_baseline"] = max(values["peak_rss"] - results[base]["peak_rss"], 0)
        values["ratio_to_model"] = values["above_baseline"] / model_bytes
        if values["above_start"] is not None:
            values["start_ratio_to_model"] = values["above_start"] / model_bytes
    results["model"] = {"bytes": model_bytes, "layers": layers, "hidden": hidden}
    for path in (ckpt, dist, *exported.values()):
        shutil.rmtree(path, ignore_errors=True)
    Path(str(whole) + ".pt").unlink(missing_ok=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    results = run(args.layers, args.hidden, args.ffn, args.vocab)
    model = results.pop("model")
    mb = 1e6
    print(
        f"model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, fp32, "
        f"{model['bytes'] / mb:,.0f} MB in {args.layers + 2} shards"
    )
    print(
        f"{'contender':<34} {'peak RSS':>10} {'above base':>11} {'/ model':>8} "
        f"{'work peak':>10} {'/ model':>8} {'time':>7}"
    )
    for name, r in results.items():
        work = "" if r["above_start"] is None else f"{r['above_start'] / mb:>8,.0f}MB"
        work_ratio = "" if r["above_start"] is None else f"{r['start_ratio_to_model']:>7.2f}x"
        print(
            f"{name:<34} {r['peak_rss'] / mb:>8,.0f}MB {r['above_baseline'] / mb:>9,.0f}MB "
            f"{r['ratio_to_model']:>7.2f}x {work:>10} {work_ratio:>8} {r['seconds']:>6.1f}s"
        )
    ours = results["mg-convert import-hf"]["above_baseline"]
    reference = results["whole-model reference"]["above_baseline"]
    print(f"import-hf / whole-model reference (above baseline): {ours / reference:.2f}x")


if __name__ == "__main__":
    main()
