"""`mg-prep vlm`: image-text pairs (LLaVA's JSON/JSONL) to WebDataset shards that
megatron-energon reads and `mg-train vlm` streams.

    mg-prep vlm --input blip_laion_cc_sbu_558k.json --image-folder images/ \\
        --output data/llava-pretrain [--shard-size 10000] [--split 99,1,0]

reads LLaVA-Pretrain / LLaVA-Instruct records, a JSON array or JSONL, each
`{"id": ..., "image": "relative/path.jpg", "conversations": [{"from": "human",
"value": "<image>\\n..."}, {"from": "gpt", "value": "..."}]}` or a caption
`{"image": ..., "text"|"caption": "..."}` (made the two-turn conversation
`<image>` → caption, as LLaVA-Pretrain ships it). Each sample becomes
`KEY.jpg` (JPEG files as they are) or `KEY.png` (other formats, losslessly) and
`KEY.json` (`{"conversations": [...], "image": the source path}`) in
`data-000000.tar`, ...; then energon's own preparation writes the dataset's
`.nv-meta/` folder (shard index, split.yaml), with a dataset.yaml of its
`CrudeWebdataset` (subflavor `llava_conversation`).

Bad images (missing, empty, truncated, not an image, CMYK, alpha, 16-bit,
zero-size, more pixels than --max-image-pixels) and bad records (no image, no
text, more than one `<image>` tag) are skipped and counted, each named on
stderr; the run fails only when nothing is left.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vlm",
        help="image-text pairs (LLaVA JSON/JSONL) to energon WebDataset shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", nargs="+", required=True, help="LLaVA-style .json (array) or .jsonl files"
    )
    parser.add_argument(
        "--image-folder",
        default=None,
        help="folder the records' relative image paths start from (default: each input "
        "file's folder)",
    )
    parser.add_argument(
        "--output", required=True, help="dataset folder to create (shards and .nv-meta/)"
    )
    parser.add_argument("--shard-size", type=int, default=10000, help="samples per tar shard")
    parser.add_argument(
        "--split",
        default="100,0,0",
        help="train,val,test weights of the shards, as energon splits them (default 100,0,0)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=89_478_485,
        help="larger images are skipped (default: Pillow's decompression-bomb limit)",
    )
    parser.set_defaults(func=run_later("vlm_cmd"))
