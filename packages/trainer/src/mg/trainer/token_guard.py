"""The training data's token ids against the model's embedding rows.

Data made with another tokenizer holds ids the embedding has no row for, and the
first batch that meets one fails deep in the forward with an ``IndexError``. At
start-up the ranks share one pass over each dataset's ``.bin`` (`check_token_ids`),
which names the file before any step runs. A dataset too large for that pass to be
a moment (more than `SCAN_BYTES_PER_RANK` of it per rank: a web-scale corpus on a
few ranks) is checked instead as its samples are read, on the host, before they
reach the device: the same one-line error, when the first such id is met.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mg.indexed_dataset import IndexedDatasetError, parse_data_path, read_blend_file
from mg.indexed_dataset.token_range import check_token_ids, scan_bytes
from mg.trainer import distributed

SCAN_BYTES_PER_RANK = 4 << 30  # about a few seconds of reading on one rank
# the sample fields that hold token ids (GPT, BERT, T5 datasets)
_TOKEN_FIELDS = ("tokens", "labels", "text", "text_enc", "text_dec")

Guard = Callable[[list[dict[str, Any]]], None]


def vocabulary_text(tokenizer_ids: int, rows: int) -> str:
    return f"the model's embedding (the tokenizer's {tokenizer_ids} ids, padded to {rows} rows)"


def check_at_start(args: Any, rows: int, tokenizer_ids: int, env: Any) -> Guard | None:
    """Scan the datasets small enough to scan (the ranks sharing each pass); the check
    of the samples of the others, or None when every dataset was scanned."""
    d = args.data
    if d.mock_data or args.family == "vlm":  # vlm: samples are tokenized as they are read
        return None
    blend = read_blend_file(d.data_args_path) if d.data_args_path else parse_data_path(d.data_path)
    part = (env.rank, env.world_size)
    scanned = [p for p in blend.prefixes if scan_bytes(p, part) <= SCAN_BYTES_PER_RANK]
    vocabulary = vocabulary_text(tokenizer_ids, rows)
    check_token_ids(
        scanned,
        rows,
        vocabulary,
        part=part,
        reduce_max=lambda top: int(distributed.all_reduce_max(float(top))),
        mmap=d.mmap_bin_files,
    )
    unscanned = [p for p in blend.prefixes if p not in scanned]
    return sample_guard(unscanned, rows, vocabulary) if unscanned else None


def sample_guard(prefixes: list[str], rows: int, vocabulary: str) -> Guard:
    """Refuse a micro-batch's samples holding an id >= `rows` (numpy, on the host)."""

    def check(samples: list[dict[str, Any]]) -> None:
        for sample in samples:
            for field in _TOKEN_FIELDS:
                ids = sample.get(field)
                if ids is None or not np.issubdtype(np.asarray(ids).dtype, np.integer):
                    continue
                top = int(np.max(ids))
                if top >= rows:
                    raise IndexedDatasetError(
                        f"the training data ({', '.join(prefixes)}) holds token id {top}, "
                        f"beyond {vocabulary}: ids must be below {rows}; the data was made "
                        "with another tokenizer. Re-run mg-prep with this model's tokenizer, "
                        "or pick the tokenizer (and vocabulary size) the data was made with"
                    )

    return check
