"""LLaVA on CPU: our vision tower's images/s and our training step's tokens/s vs
transformers' `LlavaForConditionalGeneration` on the same shapes and weights, in one run.

    uv run --frozen python bench/bench_vlm.py           # writes bench/results/vlm-cpu.md
    uv run --frozen python bench/bench_vlm.py --vision-layers 2 --vision-hidden 64 \\
        --vision-heads 2 --img 32 --patch 8 --layers 2 --hidden 64 --heads 2 --vocab 256 \\
        --seq 48 --repeats 1 --out vlm-smoke.md    # a smoke run

Their side is transformers' LLaVA (a `CLIPVisionConfig` tower, a `LlamaConfig` language
model, `attn_implementation="sdpa"` everywhere, `vision_feature_layer=-1` so both sides
run every layer, strategy "default": the class token dropped), randomly initialised.
Ours is `mg.core.models.vision.LLaVAModel` built from the same config and weights by
mg-convert's LLaVA importer (`mg.ckpt_convert.llava_hf`), what `mg-train vlm` trains
after `mg-convert import-hf`; logits are checked equal (fp32) before any timing.

1. vision tower: images/s of a forward (no grad) of `vision_model` vs transformers'
   `CLIPVisionModel` (LLaVA's `vision_tower`) on a batch of images; fp32, and bf16 as
   weights cast to bfloat16 on both sides (inference; no autocast).
2. training step: tokens/s of one step on one image + text per sample (the combined
   sequence `--seq` long, the image's patches inside it): zero_grad → forward → loss →
   backward → clip 1.0 → AdamW. Ours is `Trainer.train_step`'s body with the trainer's
   functions (`vlm_loss_terms`, `clip_grad_norm`, `build_optimizer`); `--fused-ce` adds
   ours with the language model's fused cross entropy (what `--cross-entropy-loss-fusion`
   gives a GPT; `mg-train vlm` refuses the flag). Theirs is a plain loop over `.loss`
   (labels -100 on image rows) with fused AdamW, as transformers' Trainer defaults to.
   bf16 is `torch.autocast("cpu", bfloat16)` on both sides, as `mg-train --bf16`; fp32
   has no autocast.

Every side runs in this process with the same `torch.set_num_threads`, one warm-up each,
then `--tower-repeats` / `--repeats` alternating repeats (the order reversed every other
repeat) so load from other jobs hits both alike; the median is reported, with ratios
ours/transformers. The results file names the CPU's instruction sets, the threads, the
shapes and the load average before and after.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
LR, BETAS, EPS, WD, CLIP = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def cpu_line() -> str:
    """The CPU's model, the best instruction set mg's CPU kernels may use (with its bf16 /
    VNNI / AMX flags) and what ATen dispatches to."""
    from mg.generate_server.cpu_isa import available, describe

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    aten = torch.backends.cpu.get_cpu_capability()
    return f"{model}, {os.cpu_count()} CPUs; ISA {describe(available())}; ATen kernels {aten}"


def hf_llava(args: argparse.Namespace):
    """transformers' LLaVA at the bench's shapes, sdpa attention, dropout off, eval-ready."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(
        hidden_size=args.vision_hidden,
        intermediate_size=args.vision_ffn or 4 * args.vision_hidden,
        num_hidden_layers=args.vision_layers,
        num_attention_heads=args.vision_heads,
        image_size=args.img,
        patch_size=args.patch,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
    )
    text = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn or _llama_ffn(args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=args.vocab - 1,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    for part in (model.model.vision_tower, model.model.language_model):
        assert part.config._attn_implementation == "sdpa", part.config._attn_implementation
    return model


def _llama_ffn(hidden: int) -> int:
    """Llama's SwiGLU width, 8h/3 rounded up to a multiple of 64."""
    return -(-8 * hidden // 3 // 64) * 64


def our_llava(hf: nn.Module, fused_loss: bool = False) -> nn.Module:
    """Our LLaVAModel from the HF model's config and weights (mg-convert's importer)."""
    from mg.ckpt_convert.llava_hf import llava_config_from_hf, llava_state_from_hf
    from mg.core.models.fused_cross_entropy import apply_cross_entropy_fusion
    from mg.core.models.vision import LLaVAModel

    config = llava_config_from_hf(hf.config.to_dict())
    assert config.language.vocab_size == hf.config.text_config.vocab_size, "vocab padded"
    state = llava_state_from_hf({k: v.detach().clone() for k, v in hf.state_dict().items()}, config)
    model = LLaVAModel(config)
    model.load_state_dict(state)
    if fused_loss:  # --cross-entropy-loss-fusion, on the language model (it owns the head)
        apply_cross_entropy_fusion(model.language_model)
    return model


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def make_batches(args: argparse.Namespace, image_tokens: int, count: int, image_token: int):
    """`count` micro-batches of one image + text per sample, in both sides' forms: ours one
    `<image>` token per image (Megatron's), theirs one per image row (transformers')."""
    gen = torch.Generator().manual_seed(1234)
    b, text = args.micro_batch, args.seq - image_tokens + 1
    if text < 2:
        sys.exit(f"--seq {args.seq}: the image alone takes {image_tokens} rows; give more")
    batches = []
    for _ in range(count):
        images = torch.randn(b, 3, args.img, args.img, generator=gen)
        words = torch.randint(0, image_token, (b, text), generator=gen)
        ours = {
            "images": images,
            "tokens": torch.cat([torch.full((b, 1), image_token), words[:, :-1]], dim=1),
            "labels": words,
            "loss_mask": torch.ones(b, text),
        }
        ids = torch.cat([torch.full((b, image_tokens), image_token), words[:, :-1]], dim=1)
        labels = ids.masked_fill(ids == image_token, -100)
        theirs = {"pixel_values": images, "input_ids": ids, "labels": labels}
        batches.append((ours, theirs))
    return batches


def check_same_model(ours: nn.Module, hf: nn.Module, batch) -> str:
    """Both sides' logits on the same images and text (fp32, eval), before any timing."""
    mine, theirs = batch
    ours.eval(), hf.eval()
    with torch.no_grad():
        a = ours(mine["images"], mine["tokens"])
        b = hf(pixel_values=theirs["pixel_values"], input_ids=theirs["input_ids"]).logits
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = float((a - b).abs().max() / b.abs().max())
    assert diff < 1e-4, f"the models disagree: max |diff| / max |logit| = {diff:.2e}"
    return f"logits equal: max |diff| / max |logit| = {diff:.1e} over {tuple(b.shape)}"


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict:
    """Seconds per call of each, run in turn after `warmup` calls each; the order is
    reversed every other repeat so that drift and load hit all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for i in range(repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def bench_tower(ours: nn.Module, hf: nn.Module, args: argparse.Namespace) -> list[str]:
    """Images/s of the vision tower's forward (no grad), fp32 and bf16 weights."""
    gen = torch.Generator().manual_seed(7)
    images = torch.randn(args.images, 3, args.img, args.img, generator=gen)
    with torch.no_grad():
        a = ours.vision_model.eval()(images)
        b = hf.model.vision_tower.eval()(images).last_hidden_state
    diff = float((a - b).abs().max() / b.abs().max())
    assert diff < 1e-4, f"the towers disagree: max |diff| / max |out| = {diff:.2e}"
    rows = [
        f"{args.images} images of 3x{args.img}x{args.img} per forward; tower outputs equal "
        f"first (fp32, max |diff| / max |out| = {diff:.1e}).",
        "",
        "| dtype | ours images/s | transformers images/s | ours/transformers | "
        "median s ours / theirs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in args.dtypes:
        dtype = DTYPES[name] or torch.float32
        mine = copy.deepcopy(ours.vision_model).to(dtype).eval()
        theirs = copy.deepcopy(hf.model.vision_tower).to(dtype).eval()
        x = images.to(dtype)

        def run(tower: nn.Module, x: torch.Tensor = x) -> Callable[[], object]:
            def call() -> object:
                with torch.no_grad():
                    return tower(x)

            return call

        times = alternate(
            {"ours": run(mine), "transformers": run(theirs)}, args.tower_repeats, args.warmup
        )
        med = {k: statistics.median(v) for k, v in times.items()}
        rate = {k: args.images / v for k, v in med.items()}
        rows.append(
            f"| {name} | {rate['ours']:,.1f} | {rate['transformers']:,.1f} | "
            f"{rate['ours'] / rate['transformers']:.2f}x | "
            f"{med['ours']:.3f} / {med['transformers']:.3f} |"
        )
        print(rows[-1], flush=True)
        del mine, theirs
    return rows


class OurStep:
    """mg-train's step for the vlm family: `Trainer.train_step` with one micro-batch."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None) -> None:
        from mg.trainer.arguments import OptimizerArgs
        from mg.trainer.optimizer import build_optimizer

        self.model, self.dtype = model.train(), dtype
        self.optimizer = build_optimizer(
            model,
            OptimizerArgs(
                lr=LR,
                weight_decay=WD,
                clip_grad=CLIP,
                adam_beta1=BETAS[0],
                adam_beta2=BETAS[1],
                adam_eps=EPS,
            ),
        )

    def __call__(self, batch: dict[str, torch.Tensor]) -> float:
        from mg.trainer.family_vlm import vlm_loss_terms
        from mg.trainer.optimizer import clip_grad_norm
        from mg.trainer.training import _autocast

        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(torch.device("cpu"), self.dtype):
            total, tokens = vlm_loss_terms(self.model, batch)
        loss = total / tokens.clamp(min=1)
        loss.backward()
        if math.isfinite(clip_grad_norm(self.model, CLIP)):  # no inf scan without fp16
            self.optimizer.step()
        return float(loss.detach())


class TheirStep:
    """A plain loop around transformers' LLaVA: autocast, `.loss`, backward, clip, AdamW."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None) -> None:
        from mg.trainer.optimizer import param_groups

        self.model, self.dtype = model.train(), dtype
        # fused: transformers' Trainer default (optim "adamw_torch_fused", torch >= 2.8)
        self.optimizer = torch.optim.AdamW(
            param_groups(model, WD), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True
        )

    def __call__(self, batch: dict[str, torch.Tensor]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype is not None):
            loss = self.model(**batch).loss
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return float(loss.detach())


def bench_training(hf: nn.Module, args: argparse.Namespace) -> list[str]:
    """Tokens/s of one AdamW step on image + text sequences, ours (plain, fused CE) vs HF."""
    image_tokens = (args.img // args.patch) ** 2
    tokens = args.micro_batch * args.seq
    rows = [
        f"Micro-batch {args.micro_batch} samples of one image ({image_tokens} image rows) + "
        f"{args.seq - image_tokens} text tokens = {args.seq} rows each: {tokens} tokens per "
        "step. AdamW lr 1e-4, wd 0.01, clip 1.0; every parameter trained (both towers and "
        "the projector).",
        "",
        "| dtype | ours | ours tok/s | transformers tok/s | ours/transformers | "
        "median s ours / theirs |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    batches = make_batches(args, image_tokens, args.steps, args.vocab - 1)
    for name in args.dtypes:
        dtype = DTYPES[name]
        steps = {"ours": OurStep(our_llava(hf), dtype)}
        if args.fused_ce:
            steps["ours+fused-ce"] = OurStep(our_llava(hf, fused_loss=True), dtype)
        steps["transformers"] = TheirStep(copy.deepcopy(hf), dtype)

        def run(step: Callable[[dict], float], form: int) -> Callable[[], object]:
            def call() -> None:
                for pair in batches:
                    step(pair[form])  # form: 0 our batch, 1 theirs

            return call

        times = alternate(
            {k: run(s, int(k == "transformers")) for k, s in steps.items()},
            args.repeats,
            args.warmup,
        )
        per_step = {k: statistics.median(v) / len(batches) for k, v in times.items()}
        theirs = tokens / per_step["transformers"]
        for who in [k for k in steps if k != "transformers"]:
            mine = tokens / per_step[who]
            rows.append(
                f"| {name} | {who} | {mine:,.0f} | {theirs:,.0f} | {mine / theirs:.2f}x | "
                f"{per_step[who]:.3f} / {per_step['transformers']:.3f} |"
            )
            print(rows[-1], flush=True)
        if args.profile:
            for who, step in steps.items():
                form = 1 if who == "transformers" else 0
                profile(who, name, step, batches[0][form], args.profile_rows)
        del steps
    return rows


def profile(who: str, dtype: str, step, batch, rows: int) -> None:
    """The top ops (self CPU time) of one step, printed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch)
    print(f"\n--- {who} ({dtype}): top ops by self CPU time, one step ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    g = p.add_argument_group("vision tower (CLIP ViT)")
    g.add_argument("--vision-layers", type=int, default=6)
    g.add_argument("--vision-hidden", type=int, default=512)
    g.add_argument("--vision-heads", type=int, default=8)
    g.add_argument("--vision-ffn", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--img", type=int, default=224, help="image side in pixels")
    g.add_argument("--patch", type=int, default=16)
    g.add_argument("--images", type=int, default=8, help="images per tower forward")
    g = p.add_argument_group("language model (Llama)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--ffn", type=int, default=None, help="default 8h/3 rounded up to 64")
    g.add_argument("--vocab", type=int, default=32000, help="a multiple of 128 (no padding)")
    g.add_argument("--seq", type=int, default=320, help="combined image + text rows")
    g.add_argument("--micro-batch", type=int, default=2, help="samples (images) per step")
    g = p.add_argument_group("timing")
    g.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="both sides")
    g.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    g.add_argument("--repeats", type=int, default=5, help="timed training alternations")
    g.add_argument(
        "--tower-repeats", type=int, default=15, help="timed tower alternations (short calls)"
    )
    g.add_argument("--warmup", type=int, default=1, help="untimed calls of each first")
    g.add_argument("--steps", type=int, default=1, help="training steps per timed call")
    g.add_argument(
        "--fused-ce",
        action="store_true",
        help="also ours with the language model's fused cross entropy (as mg-train gpt "
        "--cross-entropy-loss-fusion; mg-train vlm refuses that flag)",
    )
    g.add_argument("--profile", action="store_true", help="print top ops of one step of each")
    g.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vlm-cpu.md"))
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes: {', '.join(unknown)} unknown; choose from fp32, bf16")
    if args.img % args.patch:
        p.error(f"--img {args.img} is not a multiple of --patch {args.patch}")
    if args.vocab % 128:
        p.error(f"--vocab {args.vocab}: give a multiple of 128 (no padded rows on our side)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    hf = hf_llava(args)
    ours = our_llava(hf)
    image_tokens = (args.img // args.patch) ** 2
    same = check_same_model(ours, hf, make_batches(args, image_tokens, 1, args.vocab - 1)[0])
    print(same, flush=True)
    vision_params = n_params(ours.vision_model)
    assert vision_params == n_params(hf.model.vision_tower) - 2 * args.vision_hidden
    command = "python bench/bench_vlm.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# LLaVA on CPU: ours vs transformers' LlavaForConditionalGeneration",
        "",
        f"Command: `{command.strip()}` ({started}).",
        "",
        f"Machine: {cpu_line()}; torch {torch.__version__}, "
        f"transformers {_version('transformers')}; {torch.get_num_threads()} threads on "
        f"every side. Load average at the start {_load(load_before)}.",
        "",
        f"Model: CLIP ViT {args.vision_layers} layers, hidden {args.vision_hidden}, "
        f"{args.vision_heads} heads, ffn {hf.config.vision_config.intermediate_size}, "
        f"{args.img}px, patch {args.patch} ({image_tokens} patches + class token; "
        f"{vision_params / 1e6:.1f}M params) → 2-layer MLP projector → Llama "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, ffn "
        f"{hf.config.text_config.intermediate_size}, vocab {args.vocab} "
        f"({n_params(ours) / 1e6:.1f}M params in all, equal on both sides). Ours built by "
        f"mg-convert's LLaVA importer from transformers' weights; {same}. Median of "
        f"{args.tower_repeats} (tower) and {args.repeats} (training) alternating repeats "
        f"after {args.warmup} warm-up call(s) each.",
        "",
        "## Vision tower forward (no grad)",
        "",
    ]
    lines += bench_tower(ours, hf, args)
    del ours
    lines += ["", "## Training step (forward + backward + AdamW)", ""]
    lines += bench_training(hf, args)
    load_after = os.getloadavg()
    lines += [
        "",
        f"Load average at the end {_load(load_after)} on {os.cpu_count()} CPUs"
        + (
            ": other jobs shared the machine, so the absolute rates are low and noisy; "
            "the ratios are measured side by side and are what to compare."
            if max(load_before[0], load_after[0]) > 0.5 * (os.cpu_count() or 1)
            else "."
        ),
    ]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"written to {args.out}")


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.1f}" for x in load) + " (1, 5, 15 min)"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
