"""core's BertEmbedder on the real MiniLM-L6 weights equals transformers' BertModel: the mean
of the last hidden states between [CLS] and [SEP] (Megatron's BERT embedding), texts of
different lengths batched together (padding masked), rows in input order."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from mg.core.fixtures import fixture_dir  # noqa: E402
from mg.core.retro.bert_embedder import BertEmbedder, load_bert_checkpoint  # noqa: E402
from mg.core.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from retro_corpus import bert_vocab, botchan_documents, minilm_bert  # noqa: E402

pytestmark = [pytest.mark.compat, pytest.mark.slow]  # transformers and MiniLM load: ~50 s
TOL = 1e-5


def test_minilm_embeddings_equal_transformers(tmp_path):
    from transformers import BertModel as HFBertModel

    words = " ".join(botchan_documents(count=3)).split()
    texts = [" ".join(words[i : i + n]) for i, n in ((0, 40), (50, 3), (60, 17), (90, 120))]
    texts += ["", "<|endoftext|>"]  # nothing left: one [PAD] token, as Megatron's embedder
    checkpoint = load_bert_checkpoint(minilm_bert(tmp_path / "bert"))
    tokenizer = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=bert_vocab()))
    embedder = BertEmbedder(checkpoint.model, tokenizer, max_length=64, batch_size=4)
    ours = embedder.embed(texts)
    hf = HFBertModel.from_pretrained(fixture_dir("minilm-bert"), attn_implementation="eager")
    expected = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer.tokenize(text.replace("<|endoftext|>", ""))[:62] or [tokenizer.pad]
            hidden = hf.eval()(torch.tensor([[tokenizer.cls, *ids, tokenizer.sep]]))
            expected.append(hidden.last_hidden_state[0, 1:-1].mean(0).numpy())
    expected = np.stack(expected)
    diff = np.abs(ours - expected).max()
    print(f"MiniLM-L6 embeddings, {len(texts)} texts batched by 4: max |diff| = {diff:.1e}")
    assert diff <= TOL
    unit = BertEmbedder(checkpoint.model, tokenizer, 64, 4, normalize=True).embed(texts)
    norms = np.linalg.norm(expected, axis=1, keepdims=True)
    assert np.abs(unit - expected / norms).max() <= TOL
