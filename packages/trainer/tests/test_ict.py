"""ICT: the (query sentence, block) samples of a sentence-split corpus, and `mg-train ict`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from mg.indexed_dataset.ict_dataset import ICTDataset

sys.path.insert(0, str(Path(__file__).parent))
from sentence_data import DOCUMENTS, build_sentence_corpus, vocab_file  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Botchan sentences (one document per paragraph) and a title per document (its first
    three words)."""
    folder = tmp_path_factory.mktemp("ict")
    prefix = build_sentence_corpus(folder)
    sentences = IndexedDataset(prefix)
    tokenizer = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file()))
    titles = str(folder / "titles_text_document")
    with IndexedDatasetBuilder(titles + ".bin", np.uint16) as builder:
        for doc in range(sentences.num_documents):
            first = sentences[int(sentences.document_indices[doc])][:3]
            builder.add_document(first, [len(first)])
        builder.finalize(titles + ".idx")
    return {"prefix": prefix, "titles": titles, "tokenizer": tokenizer, "folder": folder}


def test_ict_samples(corpus):
    sentences, titles = IndexedDataset(corpus["prefix"]), IndexedDataset(corpus["titles"])
    tok = corpus["tokenizer"]
    documents = np.arange(DOCUMENTS - 20)
    dataset = ICTDataset(
        sentences, documents, 300, 64, tok, titles=titles, query_in_block_prob=0.0, seed=7
    )
    bounds = sentences.document_indices
    assert len(dataset) == 300 and len(dataset.blocks) < 300  # more than one epoch of blocks
    for start, end, doc, _ in dataset.blocks:
        assert bounds[doc] <= start < end <= bounds[doc + 1] and end - start >= 2
    for idx in (0, 1, 17, 299):
        sample = dataset[idx]
        start, end, doc, _ = sample["block_data"]
        block = [sentences[i].tolist() for i in range(start, end)]
        query = sample["query_tokens"][: sample["query_pad_mask"].sum()].tolist()
        assert query[0] == tok.cls and query[-1] == tok.sep and query[1:-1] in block
        context = sample["context_tokens"][: sample["context_pad_mask"].sum()].tolist()
        title = titles[doc].tolist()
        assert context[: len(title) + 2] == [tok.cls, *title, tok.sep] and context[-1] == tok.sep
        rest = [s for s in block if s != query[1:-1]]
        assert context[len(title) + 2 : -1] == [t for s in rest for t in s][: 64 - 3 - len(title)]
        assert (sample["context_tokens"][sample["context_pad_mask"] == 0] == tok.pad).all()
        assert all(np.array_equal(v, dataset[idx][k]) for k, v in sample.items())  # same draw
    kept = ICTDataset(sentences, documents, 50, 64, tok, titles=titles, query_in_block_prob=1.0)
    sample = kept[3]
    query = sample["query_tokens"][1 : sample["query_pad_mask"].sum() - 1].tolist()
    context = sample["context_tokens"][: sample["context_pad_mask"].sum()].tolist()
    assert any(context[i : i + len(query)] == query for i in range(len(context)))


def test_titles_must_match_documents(corpus):
    sentences = IndexedDataset(corpus["prefix"])
    with pytest.raises(ValueError, match="one title per document"):
        ICTDataset(sentences, np.arange(10), 10, 64, corpus["tokenizer"], titles=sentences)


def tiny_bert_checkpoint(folder: Path, vocab_size: int = 30592) -> str:
    """A random 2-layer BERT over MiniLM's vocabulary, saved as mg-train bert saves one."""
    import torch

    from mg.core.checkpoint.model_io import save_model
    from mg.core.models.bert import BertModel
    from mg.core.models.config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
        vocab_size=vocab_size, seq_length=64, max_position_embeddings=64,
    )  # fmt: skip
    tokenizer = TokenizerConfig("BertWordPieceLowerCase", vocab_file=vocab_file())
    save_model(folder, BertModel(config), config, tokenizer)
    return str(folder)


def held_out_top1(model, dataset: ICTDataset, count: int = 64) -> float:
    """Top-1 retrieval accuracy of (query, block) pairs, each query against all blocks."""
    import torch

    from mg.core.models.biencoder import retrieval_scores, topk_accuracies

    batch = {k: torch.from_numpy(np.stack([dataset[i][k] for i in range(count)])) for k in
             ("query_tokens", "query_pad_mask", "context_tokens", "context_pad_mask")}  # fmt: skip
    with torch.no_grad():
        q, c = model.eval()(
            batch["query_tokens"], batch["query_pad_mask"],
            batch["context_tokens"], batch["context_pad_mask"],
        )  # fmt: skip
    return topk_accuracies(retrieval_scores(q, c), [1])[1]


def ict_argv(corpus: dict, bert: str, tmp_path: Path) -> list[str]:
    from sentence_data import TINY

    argv = ["ict", *TINY, "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase"]
    argv += ["--vocab-file", vocab_file(), "--data-path", corpus["prefix"]]
    argv += ["--titles-data-path", corpus["titles"], "--bert-load", bert]
    argv += ["--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "ckpt")]
    argv += ["--split", "80,20,0", "--ckpt-format", "torch"]
    return [*argv, "--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """30 iterations of mg-train ict from a random tiny BERT."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    folder = tmp_path_factory.mktemp("ict_run")
    bert = tiny_bert_checkpoint(folder / "bert")
    result = Trainer(parse_args(ict_argv(corpus, bert, folder))).train()
    return {"bert": bert, "ckpt": folder / "ckpt", "losses": result.losses}


def test_mg_train_ict(trained):
    """mg-train ict from a BERT (--bert-load): both towers start as that BERT's encoder, the
    in-batch ICT loss goes down, and the checkpoint rebuilds the bi-encoder it trained
    (its settings recorded in the model config)."""
    import torch

    from mg.core.checkpoint import load_checkpoint
    from mg.core.models.biencoder import BiEncoderModel
    from mg.core.models.config import TransformerConfig

    losses = trained["losses"]
    print(
        f"ICT loss (16 in-batch candidates): first 5 {np.mean(losses[:5]):.3f}, last 5 "
        f"{np.mean(losses[-5:]):.3f}"
    )
    assert len(losses) == 30 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3

    state, _ = load_checkpoint(trained["ckpt"])
    config = TransformerConfig.from_dict(dict(state["mg"]["model_config"]))
    assert config.extra["biencoder"] == {
        "projection_dim": 0,
        "shared": False,
        "score_scaling": False,
    }
    model = BiEncoderModel(config)
    model.load_state_dict(state["model"])  # strict: the names the trainer saved
    start = BiEncoderModel(config)
    start.load_bert(load_checkpoint(trained["bert"])[0]["model"])
    name = "encoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(start.query_model.state_dict()[name], start.context_model.state_dict()[name])
    assert not torch.equal(
        model.query_model.state_dict()[name], start.query_model.state_dict()[name]
    )


@pytest.mark.parametrize("which", ["ckpt", "bert"])
def test_mg_eval_ict_retrieval(corpus, trained, which, capsys):
    """mg-eval ict-retrieval: the held-out blocks in a Flat Faiss index, each query searched;
    top-k accuracies equal numpy's brute force over the same towers. --load a BERT gives the
    untrained bi-encoder's."""
    import re

    import torch

    from mg.evaluate.cli import main
    from mg.evaluate.ict_retrieval import load_biencoder

    argv = ["ict-retrieval", "--load", str(trained[which]), "--data-path", corpus["prefix"]]
    argv += ["--titles-data-path", corpus["titles"], "--split", "80,20,0", "--seq-length", "64"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    print(which, line)
    found = dict(re.findall(r"(top\d+_acc|pairs): ([\d.]+)", line))
    model, _, _ = load_biencoder(str(trained[which]))
    sentences, titles = IndexedDataset(corpus["prefix"]), IndexedDataset(corpus["titles"])
    documents = np.arange(96, DOCUMENTS)  # the valid split of 80,20,0
    probe = ICTDataset(sentences, documents, 1, 64, corpus["tokenizer"], titles=titles)
    pairs = len(probe.blocks)
    dataset = ICTDataset(sentences, documents, pairs, 64, corpus["tokenizer"], titles=titles,
                         query_in_block_prob=0.0, seed=1234)  # fmt: skip
    keys = ("query_tokens", "query_pad_mask", "context_tokens", "context_pad_mask")
    batch = {k: torch.from_numpy(np.stack([dataset[i][k] for i in range(pairs)])) for k in keys}
    with torch.no_grad():
        q, c = model(batch["query_tokens"], batch["query_pad_mask"],
                     batch["context_tokens"], batch["context_pad_mask"])  # fmt: skip
    scores = (q @ c.t()).numpy()
    rank = (scores > scores.diagonal()[:, None]).sum(axis=1)
    assert int(found["pairs"]) == pairs
    for k in (1, 5, 20):
        assert float(found[f"top{k}_acc"]) == pytest.approx((rank < k).mean() * 100, abs=0.01)


def test_mg_train_ict_refusals(corpus, tmp_path, capsys):
    """One line, exit 2: a model flag that differs from --bert-load's, ICT flags elsewhere."""
    from mg.trainer.cli import main

    bert = tiny_bert_checkpoint(tmp_path / "bert")
    argv = ict_argv(corpus, bert, tmp_path)
    argv[argv.index("--hidden-size") + 1] = "64"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--hidden-size 64 differs from the 32 of --bert-load" in err and "Traceback" not in err
    gpt = ["gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    gpt += ["--seq-length", "64", "--mock-data", "--train-iters", "1", "--micro-batch-size", "1"]
    gpt += ["--lr", "1e-3"]
    gpt += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--bert-load", bert]
    assert main(gpt) == 2
    assert "--bert-load is for mg-train ict, not gpt" in capsys.readouterr().err


def test_mg_eval_ict_retrieval_on_a_bert_without_the_added_tokens(corpus, tmp_path, capsys):
    """A BERT whose embedding has exactly the vocabulary file's 30,522 rows (one imported
    from Hugging Face) is the untrained bi-encoder: text never tokenizes into the [BOS] and
    [EOS] WordPiece adds past them. One row fewer is refused by name."""
    from mg.evaluate.cli import main

    argv = ["ict-retrieval", "--data-path", corpus["prefix"], "--split", "80,20,0"]
    argv += ["--max-pairs", "16"]
    assert main([*argv, "--load", tiny_bert_checkpoint(tmp_path / "exact", 30522)]) == 0
    assert "top1_acc" in capsys.readouterr().out
    assert main([*argv, "--load", tiny_bert_checkpoint(tmp_path / "short", 30521)]) == 2
    assert "30521" in capsys.readouterr().err
