"""`mg-train gpt --sft`: packed conversations, loss on the assistant's tokens only,
attention that does not cross conversations, and a short finetune whose held-out
assistant-token loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.arguments.sft import check_sft
from mg.trainer.sft_data import PackedConversations, sft_datasets

VOCAB = 127
SYSTEM, USER, ASSISTANT, END = 1, 2, 3, 4  # role headers and the end-of-turn token


def conversation(rng: np.random.RandomState) -> tuple[list[int], list[int]]:
    """system, a user question (ids 10..59), an answer (its first token + 60, three times)
    + END; mask 1 on the answer and its END."""
    question = rng.randint(10, 60, size=rng.randint(2, 6)).tolist()
    answer = [question[0] + 60] * 3
    ids = [SYSTEM, 5, END, USER, *question, END, ASSISTANT, *answer, END]
    mask = [0] * (len(ids) - len(answer) - 1) + [1] * (len(answer) + 1)
    return ids, mask


def write_sft_data(folder: Path, count: int, seed: int = 0, prompt_format: str = "chatml") -> str:
    """Conversations as mg-prep sft writes them: PREFIX, PREFIX_loss_mask, PREFIX_sft.json."""
    prefix = str(folder / "chats_text_document")
    rng = np.random.RandomState(seed)
    with (
        IndexedDatasetBuilder(prefix + ".bin", np.uint16) as tokens,
        IndexedDatasetBuilder(prefix + "_loss_mask.bin", np.uint8) as masks,
    ):
        for _ in range(count):
            ids, mask = conversation(rng)
            tokens.add_document(ids, [len(ids)])
            masks.add_document(mask, [len(mask)])
        tokens.finalize(prefix + ".idx")
        masks.finalize(prefix + "_loss_mask.idx")
    Path(prefix + "_sft.json").write_text(json.dumps({"prompt_format": prompt_format}))
    return prefix


def packed(prefix: str, seq_length: int, num_samples: int | None = None) -> PackedConversations:
    tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
    docs = np.arange(len(tokens))
    return PackedConversations([(tokens, masks, docs)], seq_length, num_samples, seed=3)


def test_a_packed_sample_masks_loss_positions_and_attention(tmp_path):
    prefix = write_sft_data(tmp_path, 20)
    data = packed(prefix, seq_length=48)
    sample = data[0]
    tokens, labels = sample["tokens"], sample["labels"]
    loss = sample["loss_mask"]
    # the loss falls exactly on the answers' tokens and their END: ids 70..119 and 4
    assert set(labels[loss == 1].tolist()) <= set(range(70, 120)) | {END}
    answers = int(((labels >= 70) & (labels < 120)).sum())
    assert int(loss.sum()) == answers + int(((labels == END) & (loss == 1)).sum())
    # no system, user or header token is a target with loss
    for token in (SYSTEM, USER, ASSISTANT, *range(10, 60)):
        assert not loss[labels == token].any()
    # positions restart at each conversation (each starts with SYSTEM)
    starts = np.flatnonzero(tokens == SYSTEM)
    assert len(starts) >= 2 and (sample["position_ids"][starts] == 0).all()
    # block-diagonal causal: the second conversation's first token sees only itself
    blocked = sample["attention_mask"][0]
    second = starts[1]
    assert blocked[second, :second].all() and not blocked[second, second]
    assert not blocked[second - 1, :second].any()  # the first one sees all of its own
    # the first conversation's last label is the next one's SYSTEM: no loss there
    assert loss[second - 1] == 0
    # every conversation is used once per epoch, packed without overlap
    lengths = IndexedDataset(prefix).sequence_lengths
    assert sum((s["tokens"] != 0).sum() + 1 for s in data) >= lengths.sum() - len(data)


def test_epochs_repeat_until_the_samples_asked_for(tmp_path):
    prefix = write_sft_data(tmp_path, 10)
    one_epoch = len(packed(prefix, 48))
    assert len(packed(prefix, 48, num_samples=3 * one_epoch + 1)) == 3 * one_epoch + 1
    # a conversation longer than --seq-length + 1 is cut, alone in its sample
    short = packed(prefix, 6)
    assert len(short) == 10
    for sample in short:
        assert sample["tokens"].shape == (6,) and (sample["position_ids"] == np.arange(6)).all()
        assert not sample["attention_mask"][0][np.tril_indices(6)].any()


def test_perturbing_one_conversation_leaves_the_other_unchanged(tmp_path):
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB + 1,
        ffn_hidden_size=64,
        seq_length=48,
        max_position_embeddings=48,
        position_embedding_type="rope",
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    model = GPTModel(config).eval()
    sample = packed(write_sft_data(tmp_path, 20), seq_length=48)[0]
    tokens = torch.as_tensor(sample["tokens"])[None]
    second = int(np.flatnonzero(sample["tokens"] == SYSTEM)[1])
    perturbed = tokens.clone()
    perturbed[0, 1:second] = (perturbed[0, 1:second] + 7) % VOCAB  # conversation A changed
    positions = torch.as_tensor(sample["position_ids"])[None]
    labels = torch.as_tensor(sample["labels"])[None]
    mask = torch.as_tensor(sample["attention_mask"])[None]

    def run(ids, attention):
        with torch.no_grad():
            return model(ids, position_ids=positions, attention_mask=attention, labels=labels)

    base, moved = run(tokens, mask), run(perturbed, mask)
    assert torch.equal(base[0, second:], moved[0, second:])  # B's per-token loss: bit for bit
    assert (base[0, 1 : second - 1] - moved[0, 1 : second - 1]).abs().max() > 0.1
    # the same change with plain causal attention does reach B (the test can see leaks)
    causal = torch.triu(torch.ones(48, 48, dtype=torch.bool), 1)[None, None]
    leak = (run(tokens, causal)[0, second:] - run(perturbed, causal)[0, second:]).abs().max()
    assert leak > 1e-3


def sft_argv(prefix: str, tmp_path: Path, *extra: str, iters: int = 60) -> list[str]:
    return [
        "gpt",
        *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
        *("--seq-length", "48", "--max-position-embeddings", "48"),
        *("--position-embedding-type", "rope"),
        *("--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", "3", "--micro-batch-size", "8", "--global-batch-size", "8"),
        *("--train-iters", str(iters), "--eval-interval", "10", "--eval-iters", "2"),
        *("--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1000"),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)),
        *("--data-path", prefix, "--split", "90,10,0", "--seed", "1234"),
        "--sft",
        *extra,
    ]


def test_short_sft_run_held_out_assistant_loss_falls(tmp_path):
    from mg.trainer.training import Trainer

    prefix = write_sft_data(tmp_path, 600)
    argv = sft_argv(prefix, tmp_path, "--sft-tokenizer-prompt-format", "chatml", iters=80)
    result = Trainer(parse_args(argv)).train()
    (first_it, first), *_, (last_it, last) = result.validation
    assert (first_it, last_it) == (10, 80)
    # held-out answers: after 10 steps about a 50-way guess on the first answer token,
    # then the answer is read off the question
    assert last < first - 1.0, result.validation
    assert last < 1.0, result.validation


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--sft-tokenizer-prompt-format", "nemotron-h-aligned"],
            "nemotron-h-aligned: not supported",
        ),
        (
            ["--sft-mock-dataset-config-json", "x.json"],
            "--sft-mock-dataset-config-json is not supported",
        ),
        (["--eod-mask-loss"], "--eod-mask-loss does not go with --sft"),
    ],
)
def test_refused_flags_are_named(tmp_path, extra, message):
    prefix = write_sft_data(tmp_path, 40)
    with pytest.raises(ArgumentError, match=message):
        parse_args(sft_argv(prefix, tmp_path, *extra))


def test_sft_needs_gpt_local_attention_and_no_context_parallel(tmp_path):
    args = parse_args(sft_argv(write_sft_data(tmp_path, 40), tmp_path))
    args.transformer_engine.transformer_impl = "transformer_engine"
    with pytest.raises(ArgumentError, match="--sft needs --transformer-impl local"):
        check_sft(args)
    args.transformer_engine.transformer_impl = "local"
    args.distributed.context_parallel_size = 2
    with pytest.raises(ArgumentError, match="--context-parallel-size > 1"):
        check_sft(args)
    args.distributed.context_parallel_size = 1
    args.family = "bert"
    with pytest.raises(ArgumentError, match="--sft is for mg-train gpt, not bert"):
        check_sft(args)


def test_sft_needs_real_data(tmp_path):
    with pytest.raises(ArgumentError, match="--sft needs --data-path"):
        parse_args(["gpt", *sft_argv("p", tmp_path)[1:-7], "--mock-data", "--sft"])


def test_data_made_with_another_format_or_without_a_mask_is_named(tmp_path):
    prefix = write_sft_data(tmp_path, 30, prompt_format="chat_template")
    args = parse_args(sft_argv(prefix, tmp_path, "--sft-tokenizer-prompt-format", "chatml"))
    with pytest.raises(ValueError, match="rendered with chat_template"):
        sft_datasets(args, [8, 8, None])
    for suffix in (".bin", ".idx"):
        Path(prefix + "_loss_mask" + suffix).unlink()
    args = parse_args(sft_argv(prefix, tmp_path))
    with pytest.raises(ValueError, match="_loss_mask.idx/.bin cannot be read"):
        sft_datasets(args, [8, 8, None])
