"""`mg-prep sft`: chat conversations to an indexed dataset and its loss mask, for
`mg-train gpt --sft`.

    mg-prep sft --input chats.jsonl --output-prefix data/chats \\
        --tokenizer-model TOKENIZER_DIR [--sft-tokenizer-prompt-format chatml]

reads JSONL lines `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}`
(the OpenAI / Hugging Face chat format) or ShareGPT's `{"conversations": [{"from":
"human"|"gpt"|"system", "value": ...}]}`, renders each with the tokenizer folder's own
`chat_template` (as transformers' apply_chat_template) or with Megatron's `chatml`, and
writes `PREFIX_text_document.{bin,idx}` (one document per conversation) and
`PREFIX_text_document_loss_mask.{bin,idx}` (the same lengths: 1 on the assistant's
tokens, their end-of-turn token included, 0 elsewhere).
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sft",
        help="chat conversations (JSONL) to a token dataset and its loss mask, for --sft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files of conversations")
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_text_document and PREFIX_text_document_loss_mask",
    )
    parser.add_argument(
        "--tokenizer-model",
        required=True,
        help="Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json), e.g. the "
        "tokenizer/ folder of an mg checkpoint",
    )
    parser.add_argument(
        "--tokenizer-type",
        default="HuggingFaceTokenizer",
        choices=["HuggingFaceTokenizer"],
        help="only Hugging Face tokenizer folders carry a chat template",
    )
    parser.add_argument(
        "--sft-tokenizer-prompt-format",
        default=None,
        help="chat_template (default: the folder's own template) or chatml; Megatron's "
        "other names are refused",
    )
    parser.set_defaults(func=run_later("sft_cmd"))
