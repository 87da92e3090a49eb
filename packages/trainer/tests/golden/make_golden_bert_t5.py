"""Regenerate golden/{bert,t5}_tiny_botchan.json: 30 losses of a tiny BERT and T5 on CPU.

    cd /work/main && uv run --frozen python packages/trainer/tests/golden/make_golden_bert_t5.py

The corpus is `sentence_data.build_sentence_corpus` (Botchan, MiniLM WordPiece).
Only regenerate on purpose (a deliberate numerical change), and say why in the commit.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from sentence_data import build_sentence_corpus, fill, template_argv  # noqa: E402

from mg.trainer.arguments import parse_args  # noqa: E402
from mg.trainer.training import Trainer  # noqa: E402

COMMAND = "uv run --frozen python packages/trainer/tests/golden/make_golden_bert_t5.py"

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        prefix = build_sentence_corpus(Path(tmp))
        for family in ("bert", "t5"):
            argv = template_argv(family)
            result = Trainer(parse_args(fill(argv, prefix, f"{tmp}/cache"))).train()
            record = {
                "how": f"mg-train {family} with `argv` ({{data_prefix}}: "
                "sentence_data.build_sentence_corpus, {vocab_file}: minilm-bert vocab.txt, "
                "+ --data-cache-path TMP) on CPU, fp32, one process",
                "command": COMMAND,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "argv": argv,
                "lm_loss": result.losses,
                **{k.replace(" ", "_"): v for k, v in result.extra_losses.items()},
            }
            (HERE / f"{family}_tiny_botchan.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"{family}: first {result.losses[0]:.6f}, last {result.losses[-1]:.6f}")
