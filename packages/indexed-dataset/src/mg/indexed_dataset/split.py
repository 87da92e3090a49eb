"""Which data a run trains on: split strings, `--data-path` blends and sample counts.

Everything here is Megatron-LM's behaviour, number for number, so that the same
command line selects the same documents (`megatron/core/datasets/`
`blended_megatron_dataset_config.py` and `utils.py`, and
`megatron/training/training.py` for the sample counts). What we do differently
is fail early and say why, where Megatron would assert, divide by zero or
silently read a weight as a file name.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's `--split` when a `--data-path` is given without one."""


class Split(enum.Enum):
    """The three sample streams of a run, in Megatron's order."""

    train = 0
    valid = 1
    test = 2


# --- split strings ---------------------------------------------------------------------------

_SPLIT_SEPARATORS = re.compile(r"\s*[,/]\s*")


def parse_split(split: str) -> list[float]:
    """Parse a split string such as ``"969,30,1"`` into three normalised fractions.

    Up to three non-negative numbers separated by commas (or slashes, which
    Megatron also accepts); missing ones count as 0. The fractions are
    normalised with one float64 division, exactly as Megatron does, because the
    document boundaries are rounded from them.
    """
    text = split.strip()
    fields = [field for field in _SPLIT_SEPARATORS.split(text)] if text else []
    values: list[float] = []
    for field in fields:
        try:
            value = float(field)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"bad split {split!r}: {field!r} is not a non-negative number; expected up to "
                f"three comma-separated weights for train,valid,test, e.g. --split 969,30,1"
            )
        values.append(value)
    if not values or len(values) > len(Split):
        raise ValueError(
            f"bad split {split!r}: expected 1 to 3 comma-separated weights for train,valid,test, "
            f"e.g. --split 969,30,1"
        )
    values += [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise ValueError(f"bad split {split!r}: the weights add up to 0; give at least one > 0")
    weights = np.asarray(values, dtype=np.float64)
    return (weights / weights.sum()).tolist()


def split_matrix(fractions: Sequence[float]) -> list[tuple[float, float] | None]:
    """Turn split fractions into (begin, end) bookends; an empty split becomes None.

    The bookends are running sums in Python float order, as in Megatron, so
    `[0.969, 0.03, 0.001]` gives `[(0, 0.969), (0.969, 0.999), (0.999, 1.0)]`.
    """
    bounds = [0.0]
    for fraction in fractions:
        bounds.append(bounds[-1] + fraction)
    return [(b, e) if e > b else None for b, e in zip(bounds[:-1], bounds[1:], strict=True)]


def split_range(bookends: tuple[float, float], num_elements: int) -> np.ndarray:
    """The element ids `[round(b0*N), round(b1*N))` of one split, int32 like Megatron.

    Python's `round` (half to even) is what Megatron uses, so it is what we use.
    For GPT datasets the elements are sequences, which are documents unless the
    data was prepared with sentence splitting.
    """
    begin = int(round(bookends[0] * float(num_elements)))
    end = int(round(bookends[1] * float(num_elements)))
    return np.arange(begin, end, dtype=np.int32)


# --- --data-path blends -----------------------------------------------------------------------


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and, optionally, one weight each (not normalised).

    `weights is None` means "in proportion to the datasets' sizes", Megatron's
    `--data-path P1 P2` form.
    """

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prefixes:
            raise ValueError("a blend needs at least one dataset prefix")
        if self.weights is not None and len(self.weights) != len(self.prefixes):
            raise ValueError(
                f"a blend needs one weight per prefix, got {len(self.weights)} weights for "
                f"{len(self.prefixes)} prefixes"
            )

    def normalized_weights(self) -> list[float] | None:
        """Weights divided by their sum in float64, as Megatron's `normalize`."""
        if self.weights is None:
            return None
        weights = np.asarray(self.weights, dtype=np.float64)
        return (weights / weights.sum()).tolist()


def _as_weight(token: str) -> float | None:
    """The token as a weight, or None when it is not a finite number (so a prefix)."""
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_data_path(tokens: Sequence[str] | str, *, source: str = "--data-path") -> Blend:
    """Parse the three `--data-path` forms into a `Blend`.

    - `P`: one dataset;
    - `w1 P1 w2 P2 ...`: weighted datasets (weights need not sum to 1);
    - `P1 P2 ...`: datasets weighted by their number of samples.

    A string is split on whitespace. Anything else is an error that names the
    offending token, rather than Megatron's guess (it would take `0.3 a 0.7` as
    three dataset prefixes, one of them called `0.3`).
    """
    if isinstance(tokens, str):
        tokens = tokens.split()
    tokens = [token.strip() for token in tokens if token.strip()]
    if not tokens:
        raise ValueError(f"{source} is empty: give a dataset prefix, or weight/prefix pairs")
    if len(tokens) == 1:
        if _as_weight(tokens[0]) is not None:
            raise ValueError(
                f"{source} {tokens[0]!r} is a number, not a dataset prefix; give a prefix "
                f"(path without .bin/.idx), or weight/prefix pairs"
            )
        return Blend(prefixes=(tokens[0],))

    numeric = [_as_weight(token) is not None for token in tokens]
    if not any(numeric):
        return Blend(prefixes=tuple(tokens))
    if len(tokens) % 2 == 1:
        raise ValueError(
            f"{source} has {len(tokens)} entries, some of them numbers: expected weight/prefix "
            f"pairs 'w1 P1 w2 P2 ...' or prefixes only 'P1 P2 ...'"
        )
    weights: list[float] = []
    prefixes: list[str] = []
    for position in range(0, len(tokens), 2):
        raw_weight, prefix = tokens[position], tokens[position + 1]
        weight = _as_weight(raw_weight)
        if weight is None:
            raise ValueError(
                f"{source}: weight number {position // 2 + 1} is {raw_weight!r}, not a number; "
                f"expected weight/prefix pairs 'w1 P1 w2 P2 ...'"
            )
        if weight <= 0:
            raise ValueError(
                f"{source}: the weight of {prefix!r} is {raw_weight}; weights must be > 0"
            )
        if _as_weight(prefix) is not None:
            raise ValueError(
                f"{source}: {prefix!r} (after weight {raw_weight}) is a number, not a dataset "
                f"prefix; expected weight/prefix pairs 'w1 P1 w2 P2 ...'"
            )
        weights.append(weight)
        prefixes.append(prefix)
    return Blend(prefixes=tuple(prefixes), weights=tuple(weights))


def read_blend_file(path: str | os.PathLike[str]) -> Blend:
    """Read a blend file (Megatron's `--data-args-path`): a `--data-path` value in a file.

    Entries are separated by any whitespace, so a long blend can be written one
    `weight prefix` pair per line. Lines starting with `#` are comments.
    """
    with open(path, encoding="utf-8") as stream:
        lines = [line for line in stream if not line.lstrip().startswith("#")]
    return parse_data_path(" ".join(lines).split(), source=f"blend file {os.fspath(path)}")


def read_per_split_blend_file(path: str | os.PathLike[str]) -> list[Blend | None]:
    """Read Megatron's `--per-split-data-args-path` JSON: one blend per split.

    `{"train": "0.7 A 0.3 B", "valid": ["C"], "test": "D"}`; a value may be a
    string or a list of strings, a missing or null split has no data.
    """
    with open(path, encoding="utf-8") as stream:
        try:
            content = json.load(stream)
        except json.JSONDecodeError as error:
            raise ValueError(f"{os.fspath(path)}: not valid JSON: {error}") from error
    if not isinstance(content, dict):
        raise ValueError(f"{os.fspath(path)}: expected a JSON object with train/valid/test keys")
    unknown = sorted(set(content) - {split.name for split in Split})
    if unknown:
        raise ValueError(
            f"{os.fspath(path)}: unknown keys {unknown}; expected only train, valid and test"
        )
    blends: list[Blend | None] = []
    for split in Split:
        value = content.get(split.name)
        if value is None:
            blends.append(None)
        else:
            blends.append(parse_data_path(value, source=f"{os.fspath(path)} [{split.name!r}]"))
    return blends


def check_prefixes_exist(blend: Blend) -> None:
    """Fail with the missing file's name before any work is done on a blend."""
    for prefix in blend.prefixes:
        missing = [path for path in (f"{prefix}.idx", f"{prefix}.bin") if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(
                f"dataset prefix {prefix!r}: {' and '.join(missing)} not found. A prefix is the "
                f"path without the extension (data/corpus_text_document for "
                f"data/corpus_text_document.bin/.idx), as written by mg-prep."
            )


# --- sample counts ----------------------------------------------------------------------------


def samples_per_split(
    *,
    global_batch_size: int,
    eval_interval: int,
    eval_iters: int,
    train_iters: int | None = None,
    train_samples: int | None = None,
) -> tuple[int, int, int]:
    """How many samples Megatron-LM asks each split for, given the training schedule.

    - train: `train_iters * GBS`, or `--train-samples` when given;
    - valid: one evaluation every `eval_interval` iterations plus one at the
      end: `(train_iters // eval_interval + 1) * eval_iters * GBS`;
    - test: one evaluation, `eval_iters * GBS`.

    With `train_samples` and no `train_iters`, `train_iters` is
    `train_samples // GBS` (no batch-size ramp-up).
    """
    if global_batch_size <= 0:
        raise ValueError(f"global batch size must be > 0, got {global_batch_size}")
    if eval_interval <= 0:
        raise ValueError(f"eval interval must be > 0, got {eval_interval}")
    if eval_iters < 0:
        raise ValueError(f"eval iters must be >= 0, got {eval_iters}")
    if train_samples is not None:
        if train_samples < 0:
            raise ValueError(f"train samples must be >= 0, got {train_samples}")
        train = train_samples
        if train_iters is None:
            train_iters = train_samples // global_batch_size
    elif train_iters is not None:
        if train_iters < 0:
            raise ValueError(f"train iters must be >= 0, got {train_iters}")
        train = train_iters * global_batch_size
    else:
        raise ValueError("give train_iters or train_samples")
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return train, valid, test
