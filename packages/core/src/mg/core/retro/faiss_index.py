"""The project's Faiss index, read and searched the same way by `mg-prep retro`'s query
stage and by retrieval at generation time (`mg-eval`, `mg-serve`).

Faiss is an optional dependency: it is imported only when an index is opened, and a
missing Faiss is a one-line :class:`RetroProjectError` saying what to install.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from mg.core.retro.files import read_json
from mg.core.retro.project import ProjectPaths, RetroProjectError


class FaissMissingError(RetroProjectError):
    """Faiss is not installed."""


class TextEmbedder(Protocol):
    """What turns chunk texts into the index's vectors (a ``BertEmbedder``)."""

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def import_faiss(what: str = "Retro retrieval") -> Any:
    try:
        import faiss  # lazy: an optional dependency, and --help stays instant
    except ImportError:
        raise FaissMissingError(
            f"{what} needs Faiss: pip install faiss-cpu (or faiss-gpu)"
        ) from None
    return faiss


def set_search_parameters(index: Any, nprobe: int, ef_search: int) -> None:
    """--retro-query-nprobe for an IVF index, --retro-query-ef-search for HNSW (the index's
    own or its IVF's coarse quantizer); parameters an index does not have are skipped."""
    faiss = import_faiss()
    space = faiss.ParameterSpace()
    inner = faiss.downcast_index(
        index.index if isinstance(index, faiss.IndexPreTransform) else index
    )
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        ivf = None
    if ivf is not None:
        space.set_index_parameter(index, "nprobe", nprobe)
        quantizer = faiss.downcast_index(ivf.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):
            quantizer.hnsw.efSearch = ef_search
    elif isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efSearch = ef_search


def open_added_index(paths: ProjectPaths, fingerprint: str) -> Any:
    """The finished index (every database chunk added) of the folder's database; refused in
    one line when it is missing, of another database, or not what its manifest says."""
    if not paths.added_index.is_file() or not paths.index_manifest.is_file():
        raise RetroProjectError(
            f"{paths.root} has no finished index; run `mg-prep retro --retro-tasks index-build`"
        )
    manifest = read_json(paths.index_manifest)
    if manifest["database"] != fingerprint:
        raise RetroProjectError(
            f"{paths.added_index} was built from database {manifest['database']}, but "
            f"{paths.db_dir} holds database {fingerprint}; rerun --retro-tasks index-build"
        )
    index = import_faiss().read_index(str(paths.added_index))
    if index.ntotal != manifest.get("added"):
        raise RetroProjectError(
            f"{paths.added_index} does not hold what {paths.index_manifest} says"
        )
    return index


def search_chunks(embedder: TextEmbedder, index: Any, texts: Sequence[str], k: int) -> np.ndarray:
    """The ``k`` database rows nearest each text (best first, -1 where fewer exist) [n, k]."""
    if not texts:
        return np.zeros((0, k), dtype=np.int64)
    vectors = np.ascontiguousarray(embedder.embed(texts), dtype=np.float32)
    _, ids = index.search(vectors, k)
    return ids.astype(np.int64)
