"""Megatron-Core's `torch_dist` both ways, against megatron-core 0.16.1 on CPU (one rank).

megatron-core saves a GPT (GPT-2 and Llama/Qwen3 shapes) as Megatron-LM does
(`dist_checkpointing.save` of `generate_state_dict`'s entries); `mg-convert inspect`
reads its layout without loading tensors, `export-hf` gives a folder whose
`transformers` logits equal megatron-core's, `import-megatron` gives an mg
checkpoint with the same logits, and `format --to torch_dist` of that writes a
checkpoint megatron-core's `dist_checkpointing.load` fills its GPTModel from, with
the same logits again. The multi-rank versions (TP=2, PP=2, mg-train) are in the
workspace's tests/test_megatron_torch_dist_parallel.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.format_convert import convert_format  # noqa: E402
from mg.ckpt_convert.inspect_checkpoint import format_summary, summarize  # noqa: E402
from mg.ckpt_convert.megatron_lm import import_megatron, megatron_args_from_config  # noqa: E402
from mg.core.checkpoint import load_model  # noqa: E402
from mg.core.testing.megatron_dist_checkpoint import (  # noqa: E402
    dist_checkpointing_cpu_patches,
    load_into_megatron,
    save_like_megatron_lm,
)
from mg.core.testing.megatron_reference import (  # noqa: E402
    megatron_gpt_model,
    megatron_on_cpu,
    tiny_config,
)

pytestmark = pytest.mark.compat
TOL = 1e-5
QUIET = {"report": lambda *a: None}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron.core for TP = PP = 1 on CPU, able to save torch_dist."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
            patches = pytest.MonkeyPatch()
            dist_checkpointing_cpu_patches(patches)
            yield
            patches.undo()


def _perturbed(config) -> torch.nn.Module:
    """megatron-core's model with noise on every tensor (norms off 1, biases off 0)."""
    torch.manual_seed(0)
    model = megatron_gpt_model(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def _megatron_logits(model, ids) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, None)


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_megatron_torch_dist_to_hf_mg_and_back(megatron, tmp_path, shape) -> None:
    config = tiny_config(shape)
    model = _perturbed(config)
    args = megatron_args_from_config(config, None)
    args.consumed_train_samples, args.ckpt_format = 80, "torch_dist"
    save_like_megatron_lm(tmp_path / "meg", model, args, 10)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = _megatron_logits(model, ids)

    summary = summarize(tmp_path / "meg")
    assert summary["saved_by"] == "Megatron-LM" and summary["iteration"] == 10
    assert summary["keys"].startswith("Megatron-Core") and summary["parallel"] == {"tp": 1, "pp": 1}
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert summary["model_config"]["num_layers"] == config.num_layers
    assert "consumed_train_samples = 80" in format_summary(summary)

    export_hf(tmp_path / "meg", tmp_path / "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (hf(ids).logits - theirs).abs().max() <= TOL

    import_megatron(tmp_path / "meg", tmp_path / "mg", **QUIET)
    ours, _, _, info = load_model(tmp_path / "mg")
    assert info.iteration == 10
    with torch.no_grad():
        assert (ours(ids) - theirs).abs().max() <= TOL

    convert_format(tmp_path / "mg", tmp_path / "dist", "torch_dist", **QUIET)
    fresh = megatron_gpt_model(config)
    load_into_megatron(tmp_path / "dist" / "iter_0000010", fresh)
    assert torch.equal(_megatron_logits(fresh, ids), theirs)


def test_export_megatron_torch_dist_and_reshard_of_megatron_torch_dist(megatron, tmp_path) -> None:
    """export-megatron --ckpt-format torch_dist: megatron-core loads it (Megatron-LM's args
    with the target sizes); reshard of a Megatron-LM torch_dist writes the torch format."""
    from mg.ckpt_convert.cli import main
    from mg.core.checkpoint import save_checkpoint_shards
    from mg.core.checkpoint.dist_format import load_common

    config = tiny_config("llama")
    model = _perturbed(config)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    theirs = _megatron_logits(model, ids)
    args = megatron_args_from_config(config, None)
    save_like_megatron_lm(tmp_path / "meg", model, args, 10)
    main(["reshard", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "tp2"),
          "--target-tensor-parallel-size", "2"])  # fmt: skip
    assert (tmp_path / "tp2" / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt").is_file()
    ours, _, _, _ = load_model(tmp_path / "tp2")
    with torch.no_grad():
        assert (ours(ids) - theirs).abs().max() <= TOL

    save_checkpoint_shards(tmp_path / "mg", 10, {(0, 0): {"model": ours.state_dict(), "mg": {
        "model_config": config.to_dict()}, "args": {}}})  # fmt: skip
    main(["export-megatron", "--load", str(tmp_path / "mg"), "--save", str(tmp_path / "out"),
          "--ckpt-format", "torch_dist", "--target-pipeline-parallel-size", "2"])  # fmt: skip
    folder = tmp_path / "out" / "iter_0000010"
    saved = load_common(folder, allow_pickle=True)["args"]
    assert (saved.pipeline_model_parallel_size, saved.ckpt_format) == (2, "torch_dist")
    fresh = megatron_gpt_model(config)
    load_into_megatron(folder, fresh)
    assert (_megatron_logits(fresh, ids) - theirs).abs().max() <= TOL
