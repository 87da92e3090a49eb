"""Exact and MinHash de-duplication as a batch job: the local engine's decisions, in parallel.

The local engine (`mg.corpus_prep.dedup`) streams documents in input order and
keeps a document unless it duplicates one already *kept*. The same decisions
come out of three steps that need no single pass over the corpus:

1. **exact**: group the documents by their content digest; every document but
   the first of its group is an exact duplicate (a later copy of a document
   the near step drops is dropped here too, as the local chain does).
2. **candidates**: the first documents of each digest are put in the LSH
   buckets of the local index (`dedup._candidate_index`: the same bands and
   rows, a bucket being one band's slice of the MinHash signature); two
   documents are candidates when they share a bucket, as datasketch's query
   finds them, and similar when their estimated Jaccard similarity (the share
   of equal signature values) is at least the threshold.
3. **resolve**: walking the similar pairs in input order, a document is a near
   duplicate when one of its earlier similar documents was kept. This is the
   local rule exactly, and needs only the pairs, never the texts.

Steps 1 and 2 run on Ray Data (`find_duplicates_on_ray`) or, for tests and
reference, in this process (`find_duplicates`); step 3 is `resolve`, on the
driver (memory: the similar pairs).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from mg.corpus_prep.dedup import EXACT_DUPLICATE, NEAR_DUPLICATE, _candidate_index


def lsh_shape(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) of the local engine's LSH index for these settings."""
    index = _candidate_index(threshold, num_perm)
    return index.b, index.r


def band_keys(signature: np.ndarray, bands: int, rows: int) -> list[str]:
    """One bucket key per band: the band's number and its slice of the signature."""
    return [f"{b}:{signature[b * rows : (b + 1) * rows].tobytes().hex()}" for b in range(bands)]


def similar_pairs(
    orders: np.ndarray, signatures: np.ndarray, threshold: float
) -> Iterator[tuple[int, int]]:
    """`(later, earlier)` for the documents of one bucket whose estimated similarity is at
    least `threshold` (computed as the local engine does: the mean of equal values)."""
    by_order = np.argsort(orders, kind="stable")
    orders, signatures = orders[by_order], signatures[by_order]
    for i in range(1, len(orders)):
        similarity = (signatures[:i] == signatures[i]).mean(axis=1)
        for j in np.nonzero(similarity >= threshold)[0]:
            yield int(orders[i]), int(orders[j])


def resolve(pairs: Iterable[tuple[int, int]]) -> set[int]:
    """The near duplicates: in input order, a document is dropped when one of its earlier
    similar documents was kept (every document without earlier similar ones is kept)."""
    earlier: dict[int, set[int]] = defaultdict(set)
    for later, before in pairs:
        earlier[later].add(before)
    dropped: set[int] = set()
    for later in sorted(earlier):
        if any(before not in dropped for before in earlier[later]):
            dropped.add(later)
    return dropped


def find_duplicates(
    orders: np.ndarray,
    digests: list[bytes],
    signatures: np.ndarray | None,
    threshold: float,
    num_perm: int,
) -> dict[int, str]:
    """`{order: reason}` of the dropped documents, in this process (the reference)."""
    reasons: dict[int, str] = {}
    firsts: dict[bytes, int] = {}
    for position in np.argsort(orders, kind="stable"):
        order = int(orders[position])
        if digests[position] in firsts:
            reasons[order] = EXACT_DUPLICATE
        else:
            firsts[digests[position]] = int(position)
    if signatures is None:
        return reasons
    bands, rows = lsh_shape(threshold, num_perm)
    buckets: dict[str, list[int]] = defaultdict(list)
    for position in firsts.values():
        for key in band_keys(signatures[position], bands, rows):
            buckets[key].append(position)
    pairs = set()
    for members in buckets.values():
        if len(members) > 1:
            chosen = np.array(members)
            pairs.update(similar_pairs(orders[chosen], signatures[chosen], threshold))
    reasons.update({order: NEAR_DUPLICATE for order in resolve(pairs)})
    return reasons


def find_duplicates_on_ray(
    ray: Any, meta_paths: list[str], threshold: float, num_perm: int, near: bool
) -> dict[int, str]:
    """`{order: reason}` of the dropped documents, steps 1 and 2 on Ray Data.

    `meta_paths` are the shards' `.npz` files (`order`, `digest`, and `signature` when
    `near`); each is read by one task.
    """
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    documents = ray.data.from_items([{"path": path} for path in meta_paths]).flat_map(
        _meta_rows, fn_kwargs={"near": near}
    )
    marked = documents.groupby("digest").map_groups(_mark_first, batch_format="numpy")
    marked = marked.materialize()
    reasons: dict[int, str] = {}
    for batch in marked.filter(lambda row: not row["first"]).iter_batches(batch_format="numpy"):
        reasons.update(dict.fromkeys(batch["order"].tolist(), EXACT_DUPLICATE))
    if not near:
        return reasons
    bands, rows = lsh_shape(threshold, num_perm)
    buckets = marked.filter(lambda row: bool(row["first"])).flat_map(
        _bucket_rows, fn_kwargs={"bands": bands, "rows": rows}
    )
    pairs_ds = buckets.groupby("bucket").map_groups(
        _bucket_pairs, batch_format="numpy", fn_kwargs={"threshold": threshold}
    )
    pairs = set()
    for batch in pairs_ds.iter_batches(batch_format="numpy"):
        pairs.update(zip(batch["later"].tolist(), batch["earlier"].tolist(), strict=True))
    reasons.update({order: NEAR_DUPLICATE for order in resolve(pairs)})
    return reasons


def _meta_rows(item: dict[str, Any], near: bool) -> list[dict[str, Any]]:
    with np.load(item["path"]) as meta:
        orders, digests = meta["order"], meta["digest"]
        signatures = meta["signature"] if near else None
    rows = []
    for i in range(len(orders)):
        row = {"order": int(orders[i]), "digest": digests[i].tobytes().hex()}
        if signatures is not None:
            row["signature"] = signatures[i]
        rows.append(row)
    return rows


def _mark_first(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    orders = group["order"]
    marked = dict(group)
    marked["first"] = orders == orders.min()
    return marked


def _bucket_rows(row: dict[str, Any], bands: int, rows: int) -> list[dict[str, Any]]:
    signature = np.asarray(row["signature"])
    return [
        {"bucket": key, "order": row["order"], "signature": signature}
        for key in band_keys(signature, bands, rows)
    ]


def _bucket_pairs(group: dict[str, np.ndarray], threshold: float) -> dict[str, np.ndarray]:
    found = list(similar_pairs(group["order"], np.asarray(group["signature"]), threshold))
    later = np.array([pair[0] for pair in found], dtype=np.int64)
    earlier = np.array([pair[1] for pair in found], dtype=np.int64)
    return {"later": later, "earlier": earlier}
