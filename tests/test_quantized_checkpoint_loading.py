"""An mg-quantize checkpoint loads in mg-eval's and mg-serve's loaders (through core's
load_model) as quantized modules, and both compute the same logits."""

from __future__ import annotations

import torch

from mg.core.checkpoint import save_model
from mg.core.models import GPTModel
from mg.core.models.presets import tiny_llama
from mg.core.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _quantized_checkpoint(tmp_path, recipe: str, extra: list[str]):
    from mg.core.fixtures import gpt2_bpe_tokenizer_config
    from mg.quantize_export import cli

    torch.manual_seed(0)
    config = tiny_llama(vocab_size=50304, ffn_hidden_size=128)
    tokenizer = gpt2_bpe_tokenizer_config()
    model = GPTModel(config).eval()
    save_model(tmp_path / "float", model, config, tokenizer)
    save = tmp_path / recipe
    cli.main(["--load", str(tmp_path / "float"), "--save", str(save), "--recipe", recipe, *extra])
    return model, save


def test_eval_and_serve_load_quantized_checkpoints(tmp_path) -> None:
    from mg.evaluate.model_loading import load_for_eval
    from mg.generate_server.loading import load_for_serving

    ids = torch.tensor([[464, 3290, 318, 257]])
    for recipe, extra, kind in (
        ("int8_wo", [], Int8WeightOnlyLinear),
        ("int4_wo", ["--group-size", "32"], Int4WeightOnlyLinear),
    ):
        model, save = _quantized_checkpoint(tmp_path, recipe, extra)
        evaluated = load_for_eval(save)
        served = load_for_serving(save, dtype="bfloat16")
        assert isinstance(evaluated.model.decoder.layers[1].mlp.linear_fc1, kind)
        fc1 = served.model.decoder.layers[1].mlp.linear_fc1
        assert fc1.qweight.dtype in (torch.int8, torch.uint8)
        assert fc1.weight_scale.dtype == torch.bfloat16
        # mg-eval masks the padded vocabulary (50257..50303) with -inf: compare the real one
        real = evaluated.tokenizer.vocab_size
        a = evaluated.model(ids)[..., :real]
        with torch.no_grad():
            reference = model(ids)[..., :real]
        scale = float(reference.abs().max())
        assert torch.allclose(a, reference, atol=0.1 * scale)
        assert torch.allclose(served.model(ids).float()[..., :real], a, atol=0.1 * scale)


def test_tensor_and_pipeline_parallel_loads_are_refused_by_name(tmp_path) -> None:
    """A TP/PP layout on an mg-quantize checkpoint is a one-line error naming the recipe and
    the flags, from core's load_model_part and from mg-eval's and mg-serve's loaders."""
    import pytest

    from mg.core.checkpoint import CheckpointError
    from mg.core.checkpoint.model_part import load_model_part
    from mg.core.parallel.layout import ParallelLayout
    from mg.evaluate.model_loading import load_part_for_eval
    from mg.generate_server.errors import ServeSetupError
    from mg.generate_server.loading import load_for_serving

    _model, save = _quantized_checkpoint(tmp_path, "int4_wo", ["--group-size", "32"])
    expected = (
        f"{save} is quantized by mg-quantize (int4_wo): quantized checkpoints load whole on "
        "one process; run without --tensor-model-parallel-size and "
        "--pipeline-model-parallel-size (asked for TP={tp}, PP={pp})"
    )
    for load, error, tp, pp in (
        (load_model_part, CheckpointError, 2, 1),
        (load_part_for_eval, CheckpointError, 1, 2),
        (lambda s, layout: load_for_serving(s, layout=layout), ServeSetupError, 2, 1),
    ):
        with pytest.raises(error) as caught:
            load(save, ParallelLayout(tp=tp, pp=pp))
        assert str(caught.value) == expected.format(tp=tp, pp=pp)
