"""Our `torch_dist` is Megatron-Core's, both ways, at TP=2 and PP=2 (megatron-core 0.16.1 on
2 gloo CPU ranks, GPT-2 and Llama/Qwen3 shapes):

(a) megatron-core saves a torch_dist GPT as Megatron-LM does, and `mg-convert export-hf`
    turns it into a folder whose transformers logits equal megatron-core's within 1e-5;
(b) `mg-train` (2 ranks: the GPT-2 shape at PP=2, the Llama shape at TP=2) saves
    torch_dist and megatron-core's `dist_checkpointing.load` fills its GPTModel with it
    in both layouts: logits equal ours within 1e-5;
(c) `mg-train --load` resumes from a megatron-core save: the weights, iteration and
    consumed samples carry over (the optimizer state is refused with a one-line message
    naming --no-load-optim).

One 2-rank launch of megatron_torch_dist_worker.py does megatron-core's part of (a)
and (b) for both layouts and shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.core.checkpoint import load_model  # noqa: E402
from mg.core.checkpoint.dist_format import load_common, load_full_state  # noqa: E402
from mg.core.models import TransformerConfig  # noqa: E402
from mg.core.testing.launch import launch_workers, run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compat, pytest.mark.timeout(1500)]
WORKER = Path(__file__).with_name("megatron_torch_dist_worker.py")
MG_TRAIN = str(Path(sys.executable).with_name("mg-train"))
TOL = 1e-5
REAL_VOCAB = 127  # NullTokenizer --vocab-size 127: row 127 is Megatron's padding
SHAPES = {
    "gpt2": [],
    "llama": [
        *("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"),
        *("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
        *("--group-query-attention", "--num-query-groups", "2", "--qk-layernorm"),
    ],
}
TRAINED_AT = {
    "gpt2": ["--pipeline-model-parallel-size", "2"],
    "llama": ["--tensor-model-parallel-size", "2"],
}


def _mg_train_argv(work: Path, shape: str, *extra: str) -> list[str]:
    return [
        *("gpt", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
        *("--ffn-hidden-size", "96", "--seq-length", "16", "--max-position-embeddings", "32"),
        *("--mock-data", "--vocab-size", str(REAL_VOCAB), "--make-vocab-size-divisible-by", "64"),
        *("--data-cache-path", str(work / "cache"), "--micro-batch-size", "2"),
        *("--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1"),
        *SHAPES[shape],
        *extra,
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("megatron_torch_dist")
    configs = {}
    for shape in SHAPES:
        save = work / shape / "mg-train"
        argv = _mg_train_argv(work, shape, *TRAINED_AT[shape], "--train-iters", "3")
        outcomes = run_ranks(MG_TRAIN, 2, [*argv, "--save", str(save)], timeout=600)
        assert all(o.returncode == 0 for o in outcomes), outcomes[0].log[-3000:]
        (folder,) = save.glob("iter_*")
        configs[shape] = load_common(folder)["mg"]["model_config"]
    (work / "configs.json").write_text(json.dumps(configs))
    ids = torch.randint(0, REAL_VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    torch.save(ids, work / "ids.pt")
    launch_workers(str(WORKER), 2, [str(work)], timeout=900)
    return work


def _megatron_logits(work: Path, shape: str, layout: str, what: str) -> torch.Tensor:
    """The vocabulary shards of the last stage's tensor ranks, joined ([b, s, V])."""
    shards = sorted((work / shape).glob(f"{layout}-{what}-tp*.pt"))
    return torch.cat([torch.load(p) for p in shards], dim=-1)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_megatron_save_exports_to_transformers(work, tmp_path, shape, layout) -> None:
    """(a)"""
    ids = torch.load(work / "ids.pt")
    theirs = _megatron_logits(work, shape, layout, "megatron")
    export_hf(work / shape / f"megatron-{layout}", tmp_path / "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        diff = (hf(ids).logits - theirs).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_megatron_core_loads_mg_train_torch_dist(work, shape) -> None:
    """(b): mg-train's save (GPT-2 at PP=2, Llama at TP=2) into megatron-core at TP=2 and
    PP=2, against our model read from the same checkpoint."""
    ids = torch.load(work / "ids.pt")
    ours, _, _, _ = load_model(work / shape / "mg-train")
    with torch.no_grad():
        expected = ours(ids)[..., :REAL_VOCAB]
    for layout in ("tp2", "pp2"):
        theirs = _megatron_logits(work, shape, layout, "mg-train")[..., :REAL_VOCAB]
        diff = (theirs - expected).abs().max().item()
        assert diff <= TOL, (layout, diff)


def test_megatron_core_reads_mg_train_generators(work) -> None:
    """(b) continued: each pipeline stage's `rng_state` of mg-train's PP=2 save, read by
    megatron-core as Megatron-LM's load_checkpoint reads it: its `get_rng_state` list,
    the stages' own generators (Megatron seeds them seed + 100 · stage)."""
    stages = [torch.load(work / "gpt2" / f"rng-pp{p}-tp0.pt", weights_only=False) for p in (0, 1)]
    for rng_state in stages:
        (state,) = rng_state
        assert set(state) == {
            "random_rng_state",
            "np_rng_state",
            "torch_rng_state",
            "cuda_rng_state",
            "rng_tracker_states",
        }
    assert not torch.equal(stages[0][0]["torch_rng_state"], stages[1][0]["torch_rng_state"])


def test_mg_train_resumes_from_megatron_core_save(work, tmp_path) -> None:
    """(c): the Llama shape Megatron saved at TP=2, resumed by mg-train on one process."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    load = work / "llama" / "megatron-tp2"
    argv = _mg_train_argv(tmp_path, "llama", "--load", str(load), "--train-iters", "12")
    refused = subprocess.run([MG_TRAIN, *argv], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("mg-train: error:") and "--no-load-optim" in line

    trainer = Trainer(parse_args([*argv, "--no-load-optim"], world_size=1))
    assert trainer.state.iteration == 10 and trainer.state.consumed_train_samples == 80
    saved = load_full_state(load / "iter_0000010")
    loaded = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    loaded = {k.removeprefix("module."): v for k, v in loaded.items()}
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    result = trainer.train()
    assert trainer.state.iteration == 12 and trainer.state.consumed_train_samples == 88
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))


def test_megatron_configs_are_the_trained_ones(work) -> None:
    """The shapes both sides used: mg-train's recorded configs (vocabulary padded to 128)."""
    configs = json.loads((work / "configs.json").read_text())
    for config in map(TransformerConfig.from_dict, configs.values()):
        assert config.vocab_size == 128 and config.num_layers == 2
    assert TransformerConfig.from_dict(configs["llama"]).qk_layernorm
