"""What a refresh has published: the manifest (JSON) and the blend files (`--data-path` lists).

``OUT/manifest.json`` records, per input file (path relative to the input
folder), the sha256 of its bytes, its size and mtime, and the shard written
for each dataset of it; plus the fingerprint of the tokenizer and options the
shards were made with. The next refresh compares the input folder against it.

``OUT/blend.txt`` is what `mg-train --data-args-path` (and Megatron-LM's)
reads: one ``weight prefix`` line per shard, weight = tokens in the shard,
prefixes absolute, in input-path order. Shards without tokens are left out
(a weight must be > 0). With several datasets per input (several json keys)
each gets ``blend_<name>.txt`` too, e.g. ``blend_title_document.txt``, and
``blend.txt`` is the first key's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "manifest.json"
BLEND_NAME = "blend.txt"
MANIFEST_FORMAT = "mg-refresh-manifest"
MANIFEST_VERSION = 1


class ManifestError(Exception):
    """The manifest exists but cannot be used."""


@dataclass(frozen=True)
class Shard:
    """One indexed dataset made from one input file for one dataset name (e.g. text_document)."""

    prefix: str  # relative to the output folder
    documents: int
    tokens: int


@dataclass(frozen=True)
class InputRecord:
    sha256: str
    size: int
    mtime_ns: int
    shards: dict[str, Shard]  # dataset name (e.g. "text_document") -> shard


@dataclass
class Manifest:
    fingerprint: str
    options: dict[str, Any]
    datasets: list[str]  # dataset names in blend order: the first one is blend.txt
    inputs: dict[str, InputRecord] = field(default_factory=dict)
    generation: int = 0
    published_at: str = ""

    def to_json(self) -> str:
        body = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "generation": self.generation,
            "published_at": self.published_at,
            "fingerprint": self.fingerprint,
            "options": self.options,
            "datasets": self.datasets,
            "inputs": {path: asdict(record) for path, record in sorted(self.inputs.items())},
        }
        return json.dumps(body, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            body = json.loads(text)
            if body.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"not a refresh manifest (format {body.get('format')!r})")
            if body.get("version") != MANIFEST_VERSION:
                raise ValueError(f"manifest version {body.get('version')} is not supported")
            inputs = {
                path: InputRecord(
                    sha256=record["sha256"],
                    size=record["size"],
                    mtime_ns=record["mtime_ns"],
                    shards={name: Shard(**shard) for name, shard in record["shards"].items()},
                )
                for path, record in body["inputs"].items()
            }
            return cls(
                fingerprint=body["fingerprint"],
                options=body["options"],
                datasets=list(body["datasets"]),
                inputs=inputs,
                generation=body["generation"],
                published_at=body["published_at"],
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ManifestError(
                f"{source}: cannot read the refresh manifest ({err}). It is written atomically, "
                "so this is not a half-written file: restore it from a backup, or move the output "
                "folder aside and refresh from scratch."
            ) from err


def load_manifest(output_dir: str | os.PathLike[str]) -> Manifest | None:
    """The published manifest, or None before the first refresh."""
    path = os.path.join(output_dir, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, path)


def blend_names(datasets: list[str]) -> dict[str, str]:
    """Blend file name per dataset: blend.txt for the first, plus blend_<name>.txt when several."""
    if not datasets:
        return {}
    names = {BLEND_NAME: datasets[0]}
    if len(datasets) > 1:
        names.update({f"blend_{name}.txt": name for name in datasets})
    return names


def blend_text(manifest: Manifest, dataset: str, output_dir: str | os.PathLike[str]) -> str:
    """``weight prefix`` lines of the dataset's shards that have tokens, absolute prefixes."""
    root = os.path.abspath(output_dir)
    lines = []
    for _, record in sorted(manifest.inputs.items()):
        shard = record.shards.get(dataset)
        if shard is not None and shard.tokens > 0:
            lines.append(f"{shard.tokens} {os.path.join(root, shard.prefix)}\n")
    return "".join(lines)


def referenced_prefixes(manifest: Manifest | None) -> set[str]:
    """Prefixes (relative to the output folder) of every shard the manifest uses."""
    if manifest is None:
        return set()
    return {shard.prefix for record in manifest.inputs.values() for shard in record.shards.values()}
