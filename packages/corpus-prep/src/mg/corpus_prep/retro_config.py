"""The arguments of a Retro project, merged with what its folder recorded, and checked.

The first run writes ``config.json`` with every argument that decides what the
stages produce. A later run may leave any of them out (the recorded value is
used); a value it gives that differs from the record is refused, naming the
flag, because the folder's files were made with the recorded one. Values nobody
gave take Megatron's defaults (``RetroPreprocessingConfig``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from mg.core.retro.files import read_json, write_json
from mg.core.retro.project import ProjectPaths
from mg.corpus_prep.commands import UserError

TASKS = {
    "build": ["db-build", "index-train", "index-add", "query-neighbors"],
    "db-build": ["db-build"],
    "index-build": ["index-train", "index-add"],
    "index-train": ["index-train"],
    "index-add": ["index-add"],
    "query-neighbors": ["query-neighbors"],
    # older names of the query stage (Megatron's tools/retro/main.py, its config docstring)
    "pretraining-query-neighbors": ["query-neighbors"],
    "query-pretraining-neighbors": ["query-neighbors"],
}
ORDER = ["db-build", "index-train", "index-add", "query-neighbors"]

DEFAULTS: dict[str, Any] = {
    "retro_block_size": 100000,
    "retro_doc_block_size": 100000,
    "retro_gpt_split": "969,30,1",
    "retro_gpt_seed": 1234,
    "retro_gpt_chunk_length": 64,
    "retro_bert_max_chunk_length": 256,
    "retro_index_train_load_fraction": 1.0,
    "retro_index_add_load_fraction": 1.0,
    "retro_query_ef_search": 256,
    "retro_query_nprobe": 65536,
    "retro_query_num_neighbors_query": 200,
    "retro_query_num_neighbors_save": 20,
}


@dataclass
class RetroConfig:
    """Everything that decides a project's files (recorded in ``config.json``)."""

    retro_gpt_data_path: list[str] | None = None
    retro_gpt_split: str | None = None
    retro_gpt_seed: int | None = None
    retro_gpt_tokenizer_type: str | None = None
    retro_gpt_tokenizer_model: str | None = None
    retro_gpt_vocab_file: str | None = None
    retro_gpt_merge_file: str | None = None
    retro_gpt_chunk_length: int | None = None
    retro_gpt_seq_length: int | None = None
    retro_gpt_train_samples: int | None = None
    retro_gpt_global_batch_size: int | None = None
    retro_gpt_eval_interval: int | None = None
    retro_gpt_eval_iters: int | None = None
    retro_bert_tokenizer_type: str | None = None
    retro_bert_vocab_file: str | None = None
    retro_bert_max_chunk_length: int | None = None
    load: str | None = None
    retro_index_str: str | None = None
    retro_index_ntrain: int | None = None
    retro_index_train_load_fraction: float | None = None
    retro_index_add_load_fraction: float | None = None
    retro_query_ef_search: int | None = None
    retro_query_nprobe: int | None = None
    retro_query_num_neighbors_query: int | None = None
    retro_query_num_neighbors_save: int | None = None
    retro_block_size: int | None = None
    retro_doc_block_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PATH_FIELDS = (
    "retro_gpt_tokenizer_model",
    "retro_gpt_vocab_file",
    "retro_gpt_merge_file",
    "retro_bert_vocab_file",
    "load",
)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _normalized(name: str, value: Any) -> Any:
    """Paths absolute (a later run from another folder names the same files)."""
    if value is None:
        return None
    if name in _PATH_FIELDS:
        return os.path.abspath(value)
    if name == "retro_gpt_data_path":
        words = list(value)
        if len(words) == 1:
            words = ["1", words[0]]
        if len(words) % 2:
            raise UserError(
                f"--retro-gpt-data-path takes PREFIX or WEIGHT PREFIX pairs, got {len(words)} words"
            )
        for i in range(0, len(words), 2):
            try:
                weight = float(words[i])
            except ValueError:
                raise UserError(
                    f"--retro-gpt-data-path: {words[i]!r} is not a weight (WEIGHT PREFIX pairs)"
                ) from None
            if weight <= 0:
                raise UserError(f"--retro-gpt-data-path: weight {words[i]} must be > 0")
            words[i + 1] = os.path.abspath(words[i + 1])
        return words
    return value


def merged_config(args: argparse.Namespace, paths: ProjectPaths) -> RetroConfig:
    """The run's config: the folder's record, the flags given (which must agree with it),
    Megatron's defaults for the rest. Raises UserError naming a disagreeing flag."""
    recorded: dict[str, Any] = read_json(paths.config) if paths.config.is_file() else {}
    values: dict[str, Any] = {}
    for field in fields(RetroConfig):
        name = field.name
        given = _normalized(name, getattr(args, name, None))
        before = recorded.get(name)
        if given is not None and before is not None and given != before:
            shown = " ".join(map(str, before)) if isinstance(before, list) else before
            now = " ".join(map(str, given)) if isinstance(given, list) else given
            raise UserError(
                f"{flag(name)} {now} differs from the {shown} that {paths.config} records; "
                f"give the recorded value (or leave the flag out), or use a new --retro-project-dir"
            )
        value = given if given is not None else before
        values[name] = DEFAULTS.get(name) if value is None else value
    return RetroConfig(**values)


def record(config: RetroConfig, paths: ProjectPaths) -> None:
    """Write ``config.json`` (atomically) with the values this run settled."""
    write_json(paths.config, config.to_dict())


def task_list(spec: str) -> list[str]:
    """--retro-tasks expanded to stages, each once, in pipeline order."""
    stages: set[str] = set()
    for word in (w.strip() for w in spec.split(",")):
        if word not in TASKS:
            raise UserError(f"--retro-tasks: unknown task {word!r}; choose from {', '.join(TASKS)}")
        stages.update(TASKS[word])
    return [s for s in ORDER if s in stages]


# what each stage needs besides the defaults
_NEEDS = {
    "db-build": ["retro_gpt_data_path", "retro_gpt_tokenizer_type"],
    "index-train": ["load", "retro_index_str", "retro_index_ntrain"],
    "index-add": ["load"],
    "query-neighbors": [
        "load",
        "retro_gpt_seq_length",
        "retro_gpt_train_samples",
        "retro_gpt_global_batch_size",
        "retro_gpt_eval_interval",
        "retro_gpt_eval_iters",
    ],
}


def check(config: RetroConfig, stages: list[str]) -> None:
    """One-line UserErrors for what the stages cannot run without or cannot run with."""
    needed = {"retro_gpt_data_path", "retro_gpt_tokenizer_type"}  # every stage reads the data
    for stage in stages:
        needed.update(_NEEDS[stage])
    for name in sorted(needed):
        if getattr(config, name) is None:
            raise UserError(f"{flag(name)} is needed for {', '.join(stages)} (and not recorded)")
    if config.retro_bert_tokenizer_type is None and config.load is None:
        raise UserError(
            "give --retro-bert-tokenizer-type and --retro-bert-vocab-file, or --load (a BERT "
            "checkpoint that records its tokenizer): the chunks are re-tokenized for BERT"
        )
    positive = [
        "retro_gpt_chunk_length",
        "retro_gpt_seq_length",
        "retro_block_size",
        "retro_doc_block_size",
        "retro_bert_max_chunk_length",
        "retro_index_ntrain",
        "retro_query_num_neighbors_query",
        "retro_query_num_neighbors_save",
        "retro_gpt_global_batch_size",
        "retro_gpt_eval_interval",
        "retro_query_ef_search",
        "retro_query_nprobe",
    ]
    for name in positive:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UserError(f"{flag(name)} must be >= 1, got {value}")
    for name in ("retro_index_train_load_fraction", "retro_index_add_load_fraction"):
        value = getattr(config, name)
        if not 0 < value <= 1:
            raise UserError(f"{flag(name)} must be in (0, 1], got {value}")
    seq, chunk = config.retro_gpt_seq_length, config.retro_gpt_chunk_length
    if seq is not None and seq % chunk:
        raise UserError(
            f"--retro-gpt-seq-length {seq} is not a multiple of --retro-gpt-chunk-length {chunk}: "
            "each sample is cut into whole chunks"
        )
    if config.retro_query_num_neighbors_save > config.retro_query_num_neighbors_query:
        raise UserError(
            f"--retro-query-num-neighbors-save {config.retro_query_num_neighbors_save} is more "
            f"than --retro-query-num-neighbors-query {config.retro_query_num_neighbors_query}"
        )
