"""`mg-train retro` on a small Retro project: samples with their neighbours, training,
Retro-fitting from a GPT checkpoint, and the flags refused by name.

The project folder is written here in `mg.core.retro`'s layout (the chunk database of
the training data, random neighbours for every queried chunk), so these tests need
neither Faiss nor a BERT; `mg-prep retro`'s own tests check the real neighbours."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mg.core.retro.chunk_db import ChunkDatabase
from mg.core.retro.files import save_array, write_json
from mg.core.retro.project import ProjectPaths, block_name, database_fingerprint
from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, samples_per_split
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.families import get_family
from mg.trainer.training import Trainer

SEQ, CHUNK, SAVED, VOCAB = 32, 8, 3, 127
PROJECT = dict(gbs=4, train_samples=48, eval_interval=6, eval_iters=1, split="90,10,0")


def write_corpus(prefix: Path, documents: int = 60, seed: int = 0) -> str:
    """Documents of 20-80 consecutive token ids (mod VOCAB - 1, from a random start: the
    next token is learnable), each ending in the NullTokenizer's end-of-document id."""
    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetBuilder(f"{prefix}.bin", np.uint16) as builder:
        for _ in range(documents):
            start, length = rng.integers(0, VOCAB - 1), rng.integers(20, 80)
            ids = [*((start + np.arange(length)) % (VOCAB - 1)).tolist(), VOCAB - 1]
            builder.add_document(ids, [len(ids)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def write_project(root: Path, prefix: str, seed: int = 0) -> Path:
    """A finished Retro project over `prefix`: its chunks, and SAVED random neighbours of
    every chunk of the train and valid samples `mg-prep retro` would have queried."""
    paths = ProjectPaths.of(root)
    dataset = IndexedDataset(prefix)
    rows = [
        (0, doc, start, min(start + CHUNK, int(length)), 0)
        for doc, length in enumerate(dataset.sequence_lengths)
        for start in range(0, int(length), CHUNK)
    ]
    chunks = np.array(rows, dtype=np.uint32)
    infos = [
        {
            "prefix": prefix,
            "ratio": 1.0,
            "n_docs": len(dataset),
            "n_docs_train": len(dataset),
            "n_tokens": int(dataset.sequence_lengths.sum()),
        }
    ]
    fingerprint = database_fingerprint(chunks, infos)
    save_array(paths.chunks, chunks)
    write_json(paths.datasets, infos)
    write_json(paths.db_manifest, {"fingerprint": fingerprint, "n_chunks": len(chunks)})
    write_json(
        paths.config,
        {
            "retro_gpt_data_path": ["1", prefix],
            "retro_gpt_split": PROJECT["split"],
            "retro_gpt_seed": 1234,
            "retro_gpt_chunk_length": CHUNK,
            "retro_gpt_seq_length": SEQ,
            "retro_gpt_train_samples": PROJECT["train_samples"],
            "retro_gpt_global_batch_size": PROJECT["gbs"],
            "retro_gpt_eval_interval": PROJECT["eval_interval"],
            "retro_gpt_eval_iters": PROJECT["eval_iters"],
            "retro_query_num_neighbors_save": SAVED,
        },
    )
    counts = samples_per_split(
        global_batch_size=PROJECT["gbs"],
        eval_interval=PROJECT["eval_interval"],
        eval_iters=PROJECT["eval_iters"],
        train_samples=PROJECT["train_samples"],
    )
    rng = np.random.default_rng(seed)
    for split, samples in zip(("train", "valid"), counts, strict=False):
        n = samples * (SEQ // CHUNK)
        neighbours = rng.integers(-1, len(chunks), (n, SAVED))  # -1: fewer found
        save_array(paths.query_dir(split) / block_name(0, n), neighbours)
        write_json(
            paths.query_manifest(split),
            {"database": fingerprint, "n_chunks": n, "block_size": n, "num_neighbors": SAVED},
        )
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("retro")
    prefix = write_corpus(root / "data" / "corpus")
    return {"prefix": prefix, "dir": str(write_project(root / "project", prefix))}


def retro_argv(project: dict, tmp_path: Path, *extra: str, family: str = "retro") -> list[str]:
    argv = [
        family,
        *("--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
        *("--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine"),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10"),
        *("--eval-interval", "10", "--eval-iters", "1", "--log-interval", "1000"),
        *("--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234"),
        *("--data-path", project["prefix"], "--split", PROJECT["split"]),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)),
        *("--data-cache-path", str(tmp_path / "cache"), "--ckpt-format", "torch"),
    ]
    if family == "retro":
        argv += [
            *("--retro-add-retriever", "--retro-project-dir", project["dir"]),
            *("--retro-encoder-hidden-dropout", "0", "--retro-encoder-attention-dropout", "0"),
        ]
    return [*argv, *extra]


def test_samples_carry_their_chunks_neighbours(project: dict, tmp_path: Path) -> None:
    """Sample i's neighbour tokens are the database's tokens of the first k saved
    neighbours of its chunks, each followed by its continuation."""
    args = parse_args(retro_argv(project, tmp_path, "--retro-num-neighbors", "2"))
    tokenizer = type("Null", (), {"eod": VOCAB - 1, "pad": VOCAB - 1, "vocab_size": VOCAB})()
    train, valid, _ = get_family("retro").build_datasets(args, tokenizer, [40, 4, 0])
    paths = ProjectPaths.of(project["dir"])
    neighbours = np.load(paths.query_dir("train") / block_name(0, 48 * 4))
    database = ChunkDatabase(
        np.load(paths.chunks), [IndexedDataset(project["prefix"])], CHUNK, VOCAB - 1
    )
    for i in (0, 7, 39):
        sample = train[i]
        assert sample["tokens"].shape == (SEQ,)
        assert sample["neighbor_tokens"].shape == (SEQ // CHUNK, 2, 2 * CHUNK)
        for c in range(SEQ // CHUNK):
            expected = database.retrieved_tokens(neighbours[i * 4 + c, :2], 2)
            np.testing.assert_array_equal(sample["neighbor_tokens"][c], expected)
    assert valid is not None and valid[0]["neighbor_tokens"].shape == (4, 2, 16)


def test_retro_trains_and_loss_goes_down(project: dict, tmp_path: Path) -> None:
    result = Trainer(parse_args(retro_argv(project, tmp_path, "--train-iters", "10"))).train()
    assert len(result.losses) == 10
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses  # 4.85 -> 4.77 seen
    [(iteration, valid_loss)] = result.validation
    assert iteration == 10 and np.isfinite(valid_loss)


def test_retro_fitting_from_a_gpt_checkpoint(project: dict, tmp_path: Path) -> None:
    """`--load GPT --no-load-optim --finetune`: the GPT's weights are the Retro model's
    GPT weights at iteration 0; the cross-attention and encoder are initialised."""
    gpt_dir = tmp_path / "gpt"
    gpt_argv = retro_argv(project, tmp_path, "--save", str(gpt_dir), family="gpt")
    Trainer(parse_args([*gpt_argv, "--train-iters", "2", "--save-interval", "2"])).train()
    saved = torch.load(
        gpt_dir / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )["model"]

    argv = retro_argv(project, tmp_path, "--load", str(gpt_dir), "--no-load-optim", "--finetune")
    trainer = Trainer(parse_args([*argv, "--train-iters", "1"]))
    weights = trainer.model.state_dict()
    taken = [k for k in weights if k in saved]
    assert len(taken) == len(saved) - 2  # all but the final norm, which Retro has not
    for name in taken:
        torch.testing.assert_close(weights[name], saved[name], rtol=0, atol=0)
    assert any(".cross_attention.encoder." in k for k in weights if k not in saved)
    assert trainer.state.iteration == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--seq-length", "36"],
            "--seq-length 36 is not a multiple of the project's --retro-gpt-chunk-length 8",
        ),
        (["--retro-num-neighbors", "5"], "--retro-num-neighbors 5 is more than"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size with mg-train"),
        (["--split", "50,50,0"], "--split 50,50,0 differs"),
    ],
)
def test_bad_flags_are_refused_by_name(
    project: dict, tmp_path: Path, extra: list[str], message: str
) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_args(retro_argv(project, tmp_path, *extra), world_size=2)


def test_retro_flags_outside_retro_are_refused(project: dict, tmp_path: Path) -> None:
    argv = retro_argv(project, tmp_path, "--retro-num-neighbors", "3", family="gpt")
    with pytest.raises(ArgumentError, match="--retro-num-neighbors is a Retro flag"):
        parse_args(argv)
    with pytest.raises(ArgumentError, match="--retro-add-retriever"):
        parse_args([a for a in retro_argv(project, tmp_path) if a != "--retro-add-retriever"])


def test_cli_error_is_one_line_exit_2(project: dict, tmp_path: Path, capsys) -> None:
    from mg.trainer.cli import main

    assert main(retro_argv(project, tmp_path, "--seq-length", "36")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--retro-gpt-chunk-length" in err


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_checkpoint_resumes_where_it_stopped(
    project: dict, tmp_path: Path, ckpt_format: str
) -> None:
    """Saved at iteration 3 (in each format) and resumed: iterations 4..6 have the
    uninterrupted run's losses, bit for bit."""
    argv = retro_argv(project, tmp_path, "--train-iters", "6", "--lr-decay-iters", "6")
    argv += ["--ckpt-format", ckpt_format]
    whole = Trainer(parse_args(argv)).train().losses
    ckpt = str(tmp_path / "ckpt")
    stop = ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"]
    first = Trainer(parse_args([*argv, *stop])).train().losses
    resumed = Trainer(parse_args([*argv, "--load", ckpt])).train().losses
    assert first == whole[:3]
    assert resumed == whole[3:]


def test_use_checkpoint_args_reads_a_retro_checkpoint(project: dict, tmp_path: Path) -> None:
    """`--use-checkpoint-args` on a Retro checkpoint: the shape comes from its config (the
    Retro fields kept for RetroConfig), and the resumed run continues bit for bit."""
    argv = retro_argv(project, tmp_path, "--train-iters", "4", "--lr-decay-iters", "4")
    whole = Trainer(parse_args(argv)).train().losses
    ckpt = str(tmp_path / "ckpt")
    Trainer(
        parse_args([*argv, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"])
    ).train()
    shapeless = list(argv)
    i = shapeless.index("--hidden-size")
    del shapeless[i : i + 2]
    args = parse_args([*shapeless, "--load", ckpt, "--use-checkpoint-args"])
    assert args.model.hidden_size == 32
    assert args.checkpoint_model_config["retro_chunk_length"] == CHUNK
    assert Trainer(args).train().losses == whole[2:]


@pytest.mark.parametrize(
    "recompute",
    [
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "1"],
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "2"],
        ["--recompute-granularity", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", "4"],
        ["--recompute-granularity", "selective"],
        ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"]
        + ["layernorm"],
    ],
    ids=["uniform-1", "uniform-2", "block-4", "selective", "modules"],
)
def test_recompute_keeps_the_losses(project: dict, tmp_path: Path, recompute: list[str]) -> None:
    """Activation recompute of the decoder's layers (Retro layers included) and of the
    neighbour encoder's: the same losses and gradient norms as without, and it is applied
    (the encoder's layers or attention cores are recomputed too)."""
    argv = retro_argv(project, tmp_path, "--train-iters", "4", "--lr-decay-iters", "4")
    plain = Trainer(parse_args(argv)).train()
    trainer = Trainer(parse_args([*argv, *recompute]))
    encoder = trainer.model.decoder.layers[5].cross_attention.encoder
    assert any(getattr(m, "_mg_recompute", False) for m in encoder.modules())
    result = trainer.train()
    for a, b in zip(result.losses, plain.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=0), (result.losses, plain.losses)
    for a, b in zip(result.grad_norms, plain.grad_norms, strict=True):
        assert a == pytest.approx(b, rel=1e-5), (result.grad_norms, plain.grad_norms)


def test_retro_trains_in_bf16(project: dict, tmp_path: Path) -> None:
    """--bf16: the Retro model (encoder and cross-attention included) trains in bf16;
    the losses are finite, fall, and stay near fp32's without being them."""
    argv = retro_argv(project, tmp_path, "--train-iters", "6", "--lr-decay-iters", "6")
    fp32 = Trainer(parse_args(argv)).train().losses
    losses = Trainer(parse_args([*argv, "--bf16"])).train().losses
    assert len(losses) == 6 and all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert losses != fp32
    for a, b in zip(losses, fp32, strict=True):
        assert a == pytest.approx(b, abs=0.05), (losses, fp32)


def test_sequence_parallel_needs_a_sequence_multiple_of_tp(project: dict, tmp_path: Path) -> None:
    argv = retro_argv(project, tmp_path, "--tensor-model-parallel-size", "2")
    argv += ["--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "33"]
    with pytest.raises(ArgumentError, match="--sequence-parallel: --seq-length 33 must be a"):
        parse_args(argv, world_size=2)
