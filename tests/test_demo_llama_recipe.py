"""`just llama` (workflows/llama/run_llama.py): a Llama-family checkpoint -> mg -> SFT ->
served. Its wiring without running it, and (slow) the whole recipe on a tiny random-init
Hugging Face Llama with SmolLM2's real tokenizer and chat template: the served answer is
the one transformers gives greedily from the same finetuned weights."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "workflows" / "llama" / "run_llama.py"

CHATS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "Hamlet was written by William Shakespeare."},
    ],
]


def _dry_run(*args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(RECIPE), *args, "--dry-run"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_gguf_or_hf_folder_picks_the_import_and_train_flags_come_last(tmp_path):
    gguf = _dry_run("model.gguf", "chats.jsonl", "--output-dir", "out", "--train-iters", "7")
    assert gguf[0].endswith("mg-convert import-gguf model.gguf --save out/imported --overwrite")
    hf = _dry_run("hf-folder", "chats.jsonl", "--output-dir", "out")
    assert hf[0].endswith("mg-convert import-hf hf-folder --save out/imported --overwrite")
    assert "--tokenizer-model out/imported/tokenizer" in gguf[1]
    # the recipe's defaults first, the caller's flags after them (argparse: the last wins)
    train = gguf[2].split()
    assert train.index("--train-iters") < len(train) - 1 - train[::-1].index("--train-iters")
    assert train[len(train) - 1 - train[::-1].index("--train-iters") + 1] == "7"
    assert gguf[3].endswith("mg-serve --load out/finetuned --port 5000")


def test_a_source_that_is_neither_is_refused_in_one_line(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("")
    result = subprocess.run(
        [sys.executable, str(RECIPE), str(tmp_path), str(chats)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"SRC {tmp_path}: neither a .gguf file nor a folder with config.json"
    ]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # minutes on two quiet cores; a loaded machine is slower
def test_tiny_hf_llama_imported_finetuned_and_served(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from mg.ckpt_convert.gguf_file import metadata, open_reader
    from mg.ckpt_convert.gguf_tokenizer import write_tokenizer
    from mg.core.fixtures import FixtureError, fixture_path

    try:
        gguf = fixture_path("smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except FixtureError as exc:
        pytest.skip(f"fixture smollm2-gguf cannot be fetched: {exc}")
    hf = tmp_path / "tiny-llama"
    hf.mkdir()
    assert write_tokenizer(metadata(open_reader(gguf)), gguf, hf / "tokenizer", 2048)
    for file in (hf / "tokenizer").iterdir():
        shutil.move(str(file), hf / file.name)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 20))
    out = tmp_path / "out"
    question = "What is the capital of France?"
    result = subprocess.run(
        [
            sys.executable,
            str(RECIPE),
            str(hf),
            str(chats),
            "--output-dir",
            str(out),
            "--ask",
            question,
            "--max-tokens",
            "6",
            "--train-iters",
            "3",
            "--seq-length",
            "128",
            "--global-batch-size",
            "2",
            "--lr",
            "1e-3",
            "--lr-warmup-iters",
            "0",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"\| lm loss: ([\d.E+-]+) \|", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # lr 1e-3 on 20 copies of 2 chats
    answer = re.search(rf"Q: {re.escape(question)}\nA: (.*)\n", result.stdout).group(1)

    # transformers, greedy, on the finetuned weights exported back to Hugging Face
    exported = tmp_path / "exported"
    subprocess.run(
        [
            str(ROOT / "bin" / "mg-convert"),
            "export-hf",
            "--load",
            str(out / "finetuned"),
            "--save",
            str(exported),
        ],  # fmt: skip
        check=True,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,
    )
    with torch.no_grad():
        tuned = model.generate(ids, max_new_tokens=6, do_sample=False)
    expected = tokenizer.decode(tuned[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer == expected.strip() or answer == expected
    original = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():  # finetuning changed the weights
        assert not torch.equal(original.model.norm.weight, model.model.norm.weight)
