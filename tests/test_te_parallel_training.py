"""mg-train with `--transformer-impl transformer_engine` under tensor (+ sequence) and context
parallelism trains the local spec's numbers, and mg-convert reads its TP=2 checkpoint.

On the CPU, Transformer Engine is the stand-in package (mg.core.testing.te_standin: TE's
constructor arguments and its tensor- and context-parallel collectives in plain PyTorch), so
these runs check how mg-train drives TE: the groups, column/row modes and sequence
parallelism its modules are told, and the parameters they are lent. One 2-rank gloo launch
trains, 10 iterations each (fp32, dropout off): the local spec at TP=2 and the TE spec at
TP=2, both saving torch_dist checkpoints; the TE spec at TP=2 with --sequence-parallel; the
local and the TE spec at CP=2. One process trains the local spec as the reference.

Tolerance: losses equal to 1e-5 relative at every iteration (parallelism changes only the
order of float sums; measured 5e-8 at TP=2, with or without SP, and 3e-8 at CP=2). The TE
checkpoint saved at TP=2 is summarised by `mg-convert inspect` and read (merged to one
process) under Megatron's TE-spec names and exported by `export-hf`; its logits, in mg and in
transformers, equal the local-spec checkpoint's within 1e-5 (measured 6e-8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.inspect_checkpoint import format_summary, summarize  # noqa: E402
from mg.core.checkpoint import load_model  # noqa: E402
from mg.core.testing.launch import launch_workers  # noqa: E402
from mg.trainer.arguments import parse_args  # noqa: E402
from mg.trainer.training import Trainer  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("te_parallel_worker.py")
ITERS = 10
RTOL = 1e-5
TE = ["--transformer-impl", "transformer_engine"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
CP2 = ["--context-parallel-size", "2", "--make-vocab-size-divisible-by", "128"]
LLAMA = [
    *("--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64"),
    *("--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"),
    *("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
]


def _argv(work: Path, *extra: str) -> list[str]:
    """A tiny Llama-shaped GPT on mock data (127 token ids, padded to 128)."""
    return [
        *("gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32", "--seed", "1234"),
        *("--mock-data", "--vocab-size", "127", "--data-cache-path", str(work / "cache")),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS)),
        *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", "2", "--log-interval", "1000", "--eval-iters", "0"),
        *("--attention-dropout", "0", "--hidden-dropout", "0", "--distributed-backend", "gloo"),
        *LLAMA,
        *extra,
    ]


RUNS = {
    "local-tp2": [*TP2, "--save", "{work}/local", "--save-interval", str(ITERS)],
    "te-tp2": [*TE, *TP2, "--save", "{work}/te", "--save-interval", str(ITERS)],
    "te-tp2-sp": [*TE, *TP2, "--sequence-parallel"],
    "local-cp2": CP2,
    "te-cp2": [*TE, *CP2],
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("te_parallel")


@pytest.fixture(scope="module")
def losses(work: Path) -> dict[str, list[float]]:
    argvs = [[a.format(work=work) for a in _argv(work, *extra)] for extra in RUNS.values()]
    out = work / "losses.json"
    launch_workers(str(WORKER), 2, [str(out), json.dumps(argvs)], timeout=900)
    runs = dict(zip(RUNS, json.loads(out.read_text()), strict=True))
    one = _argv(work, "--make-vocab-size-divisible-by", "128")
    runs["one-process"] = Trainer(parse_args(one)).train().losses
    return runs


@pytest.mark.parametrize("run", ["te-tp2", "te-tp2-sp", "te-cp2"])
def test_te_spec_parallel_training_matches_local_spec(losses, run: str) -> None:
    local = losses["local-cp2" if "cp" in run else "local-tp2"]
    assert len(losses[run]) == ITERS
    assert losses[run] == pytest.approx(local, rel=RTOL)
    assert losses[run] == pytest.approx(losses["one-process"], rel=RTOL)
    assert losses[run][-1] < losses[run][0]


def test_te_tp2_checkpoint_reads_and_exports_as_the_local_one(losses, work: Path) -> None:
    summary = summarize(work / "te")
    assert summary["parallel"]["tp"] == 2 and summary["iteration"] == ITERS
    assert summary["model_config"]["transformer_impl"] == "transformer_engine"
    assert "iteration" in format_summary(summary)
    te, te_config, _, _ = load_model(work / "te")
    local, _, _, _ = load_model(work / "local")
    assert te_config.transformer_impl == "transformer_engine"
    names = set(te.state_dict())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in names
    ids = torch.randint(0, 127, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = te.eval()(ids)
        assert (ours - local.eval()(ids)).abs().max() <= 1e-5
    logits = {}
    for name in ("te", "local"):
        export_hf(work / name, work / f"{name}-hf", progress=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(work / f"{name}-hf").eval()
        with torch.no_grad():
            logits[name] = hf(ids).logits[..., :127]
    assert (logits["te"] - ours[..., :127]).abs().max() <= 1e-5
    assert (logits["te"] - logits["local"]).abs().max() <= 1e-5
