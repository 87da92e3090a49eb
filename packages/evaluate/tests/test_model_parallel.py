"""mg-eval in a tensor/pipeline-parallel layout (gloo ranks on CPU) equals one process.

Each layout runs WikiText perplexity, LAMBADA accuracy (strict, on the model
that knows 8 of 12 passages, and last-token on a briefly trained one) and
indexed-dataset perplexity in one launch, and every number is compared with
the single-process run of the same command: perplexities within 1e-5
(relative; the sums only change order), accuracies exactly.
"""

from __future__ import annotations

import itertools
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_data import SEQ_LENGTH, botchan_paragraphs, save_gpt
from eval_ranks import THEN, failed_eval_ranks, report_metrics, run_eval_ranks

from mg.core.parallel.layout import ParallelLayout
from mg.evaluate.cli import main
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_parallel import parallelize_for_eval
from mg.indexed_dataset import IndexedDatasetBuilder

PERPLEXITY_KEYS = {"wikitext": ("avg_loss", "ppl", "adjusted_ppl"), "ppl": ("loss", "ppl")}


@pytest.fixture(scope="module")
def commands(trained, memorized, wikitext_file, lambada_file, tokenizer, tmp_path_factory):
    """The mg-eval commands every layout runs (odd counts: the last micro-batch is short)."""
    _, ckpt = trained
    _, memorized_ckpt, memorized_data = memorized
    folder = tmp_path_factory.mktemp("indexed")
    prefix = str(folder / "botchan_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for para in botchan_paragraphs(40):
        ids = tokenizer.tokenize(para) + [tokenizer.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    return [
        # 9 windows in micro-batches of 3
        ["wikitext", "--load", str(ckpt), "--valid-data", str(wikitext_file),
         "--overlapping-eval", "48", "--micro-batch-size", "3"],
        # 12 lines in micro-batches of 5, 5, 2
        ["lambada", "--load", str(memorized_ckpt), "--valid-data", str(memorized_data),
         "--strict-lambada", "--micro-batch-size", "5"],
        ["lambada", "--load", str(ckpt), "--valid-data", str(lambada_file),
         "--micro-batch-size", "4"],
        ["ppl", "--load", str(ckpt), "--data-path", prefix, "--split", "80,20,0",
         "--micro-batch-size", "3", "--data-cache-path", str(folder / "cache")],
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(commands, tmp_path_factory) -> list[dict]:
    report = tmp_path_factory.mktemp("one") / "one.jsonl"
    for argv in commands:
        assert main([*argv, "--report", str(report)]) == 0
    metrics = report_metrics(report)
    assert metrics[1]["num_correct"] == 8 and metrics[1]["num_examples"] == 12
    return metrics


def run_layout(
    commands: list[list[str]], world: int, tp: int, pp: int, folder: Path, whole: int
) -> list[dict]:
    """The metrics of every command on `world` ranks at TP x PP. The rank logs show that
    each rank of the first replica held only its part of the `whole`-parameter model."""
    report = folder / "layout.jsonl"
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    argv: list[str] = []
    for command in commands:
        argv += [*command, *layout, "--report", str(report), THEN]
    logs = run_eval_ranks(world, argv[:-1], folder)
    dp = world // (tp * pp)
    assert (
        f"using world size: {world}, data-parallel size: {dp}, "
        f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {pp}"
    ) in logs[0]
    for tp_rank, pp_rank in itertools.product(range(tp), range(pp)):
        rank = pp_rank * dp * tp + tp_rank  # Megatron's order, data-parallel rank 0
        found = re.findall(
            rf"number of parameters on \(tensor, pipeline\) model parallel rank "
            rf"\({tp_rank}, {pp_rank}\): (\d+)",
            logs[rank],
        )
        assert len(found) == len(commands), logs[rank][-2000:]
        assert 0 < int(found[0]) < whole
    return report_metrics(report)


def assert_equal_results(one: list[dict], many: list[dict]) -> None:
    assert [m.keys() for m in many] == [m.keys() for m in one]
    for task, single, parallel in zip(
        ("wikitext", "lambada", "lambada", "ppl"), one, many, strict=True
    ):
        close = PERPLEXITY_KEYS.get(task, ())
        for key, value in single.items():
            if key in close:
                assert parallel[key] == pytest.approx(value, rel=1e-5), (task, key)
            else:  # counts and accuracies: exactly
                assert parallel[key] == value, (task, key)


@pytest.fixture(scope="module")
def whole(trained) -> int:
    return sum(p.numel() for p in trained[0].parameters())


def test_tensor_parallel_equals_one_process(commands, one_process, whole, tmp_path):
    assert_equal_results(one_process, run_layout(commands, 2, 2, 1, tmp_path, whole))


def test_pipeline_parallel_equals_one_process(commands, one_process, whole, tmp_path):
    assert_equal_results(one_process, run_layout(commands, 2, 1, 2, tmp_path, whole))


def test_tensor_and_data_parallel_equals_one_process(commands, one_process, whole, tmp_path):
    """4 ranks: TP=2 x DP=2 (ranks 0,1 and 2,3 hold one model each)."""
    assert_equal_results(one_process, run_layout(commands, 4, 2, 1, tmp_path, whole))


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_equals_one_process(commands, one_process, whole, tmp_path):
    """4 ranks: TP=2 x PP=2, one model replica."""
    assert_equal_results(one_process, run_layout(commands, 4, 2, 2, tmp_path, whole))


def test_layout_flags_checked(trained, wikitext_file, tmp_path, capsys):
    _, ckpt = trained
    argv = ["wikitext", "--load", str(ckpt), "--valid-data", str(wikitext_file)]
    assert main([*argv, "--tensor-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs 2 processes" in err and "torchrun --nproc-per-node 2" in err
    assert main([*argv, "--pipeline-model-parallel-size", "0"]) == 2
    assert "--pipeline-model-parallel-size must be >= 1, got 0" in capsys.readouterr().err
    logs = failed_eval_ranks(2, [*argv, "--tensor-model-parallel-size", "3"], tmp_path)
    for log in logs:
        assert "mg-eval wikitext: error: world size 2 (torchrun's processes) is not divisible by "
        "--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1" in log, log[-2000:]
        assert "Traceback" not in log


def test_model_shapes_checked(trained):
    """Layers and heads that do not split over the layout are refused by name."""
    model, _ = trained
    with pytest.raises(EvalInputError, match=r"number of layers \(2\).*pipeline parallel size"):
        parallelize_for_eval(model, ParallelLayout(pp=3, pp_rank=0))
    fake_mesh = types.SimpleNamespace(size=lambda: 3)
    with pytest.raises(EvalInputError, match=r"num_attention_heads \(4\) is not divisible"):
        parallelize_for_eval(model, ParallelLayout(tp=3, tp_mesh=fake_mesh))
    assert all(not hasattr(p, "placements") for p in model.parameters())
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv.weight, torch.Tensor)


@pytest.mark.slow
def test_llama_layout_equals_one_process(commands, tokenizer_config, tmp_path):
    """A Llama-style GPT (untied output layer, GQA, SwiGLU, RoPE, RMSNorm) at TP=2 x PP=2:
    the gated MLP's strided shards, the query groups and the last stage's own output layer."""
    from mg.core.models import GPTModel
    from mg.core.models.presets import tiny_llama

    torch.manual_seed(7)
    config = tiny_llama(vocab_size=50304, seq_length=SEQ_LENGTH, max_position_embeddings=SEQ_LENGTH)
    model = GPTModel(config)
    ckpt = save_gpt(tmp_path / "llama", model, tokenizer_config)
    llama = [[str(ckpt) if arg == commands[0][2] else arg for arg in argv] for argv in commands]
    llama = [llama[0], llama[2], llama[3]]  # wikitext, last-token LAMBADA, ppl
    report = tmp_path / "one.jsonl"
    for argv in llama:
        assert main([*argv, "--report", str(report)]) == 0
    one = report_metrics(report)
    whole = sum(p.numel() for p in model.parameters())
    many = run_layout(llama, 4, 2, 2, tmp_path / "four", whole)
    for single, parallel in zip(one, many, strict=True):
        for key, value in single.items():
            if key in ("avg_loss", "ppl", "adjusted_ppl", "loss"):
                assert parallel[key] == pytest.approx(value, rel=1e-5), key
            else:
                assert parallel[key] == value, key
