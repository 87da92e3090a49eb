"""The real MiniLM-L6 BERT (the `minilm-bert` fixture), its first --num-layers layers, as an mg
BERT checkpoint for `mg-prep retro --load`.

    python workflows/retro_vs_gpt/import_bert.py --save out/bert --num-layers 2

Embedding every chunk is most of the retrieval phase's time on a CPU; the first two of
MiniLM's six layers (real weights) cost a third and still place a passage and its
perturbed copy side by side. `--num-layers 6` is the whole model (what `mg-convert
import-hf` of the fixture folder writes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file

from mg.core.checkpoint.model_io import save_model
from mg.core.fixtures import fixture_path
from mg.core.models.bert import bert_config_from_hf, bert_state_dict_from_hf
from mg.core.tokenizers import TokenizerConfig


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--save", type=Path, required=True)
    parser.add_argument("--num-layers", type=int, default=2, choices=range(1, 7))
    args = parser.parse_args()
    hf_config = json.loads(fixture_path("minilm-bert", "config.json").read_text())
    config = bert_config_from_hf(hf_config, num_layers=args.num_layers)
    weights = bert_state_dict_from_hf(
        load_file(fixture_path("minilm-bert", "model.safetensors")), config
    )
    vocab = str(fixture_path("minilm-bert", "vocab.txt"))
    save_model(
        args.save, weights, config, TokenizerConfig("BertWordPieceLowerCase", vocab_file=vocab)
    )
    print(f"wrote MiniLM-L6's first {args.num_layers} layers to {args.save}")


if __name__ == "__main__":
    main()
