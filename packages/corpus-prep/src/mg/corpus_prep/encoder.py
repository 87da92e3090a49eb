"""Worker side of `mg-prep tokenize`: raw JSON lines in, token arrays out.

A worker gets a `Chunk` (consecutive raw lines of one file) and returns an
`EncodedChunk`: for each JSON key, the tokens of all accepted documents back
to back plus their sequence lengths, ready to be appended to the builders in
input order, and the lines it rejected with the reason.

The per-document semantics are those of Megatron's `Encoder.encode`:
- the text of a key is `json.loads(line)[key]`; a list of strings is taken as
  already split sentences (Megatron accepts that too);
- each sentence is tokenized on its own and sentences that give no tokens are
  dropped;
- `--append-eod` appends eod to a document that has tokens, counted in its
  last sentence;
- a document without tokens still ends a document (an empty boundary entry).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import numpy as np

from mg.core.tokenizers import TokenizerConfig
from mg.core.tokenizers.long_text import PIECE_CHARS
from mg.corpus_prep.gigatoken_backend import BatchEncoder, build_batch_encoder
from mg.corpus_prep.splitter import SentenceSplitter, SplitterSpec, build_splitter
from mg.corpus_prep.tokenizer_args import build_tokenizer_from_config

# Reasons a line is rejected, as counted in the summary.
NOT_UTF8 = "not UTF-8"
INVALID_JSON = "invalid JSON"
NOT_AN_OBJECT = "not a JSON object"
MISSING_KEY = "missing key"
NOT_A_STRING = "non-string value"
BAD_UNICODE = "unpaired surrogate"
SPLIT_FAILED = "sentence splitting failed"
TOKENIZE_FAILED = "tokenizer failed"
UNREADABLE = "unreadable file"

# Characters a gigatoken encoder takes before it is rebuilt (see DocumentEncoder._batch_ids):
# its word cache never shrinks. Measured with GPT-2 on a harsh case, 20 MB of English
# whose letters were rotated anew every pass (every pass all new words, which real text
# never is): a worker's RSS grew from 150 MB to 280 MB by 270 M characters and 340 MB by
# 500 M without a rebuild; rebuilt every 1 << 28 characters it stayed under 300 MB. A
# rebuild costs about 0.3 s (parsing the tokenizer.json, then a cold cache), some 5% of
# the time of 2**28 characters; every 1 << 27 it was twice that.
GIGATOKEN_REFRESH_CHARS = 1 << 28

JSON_TYPE_NAMES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    dict: "object",
    list: "array",
    str: "string",
}


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a worker needs to build its encoder (picklable, sent once)."""

    json_keys: tuple[str, ...]
    append_eod: bool
    tokenizer_config: TokenizerConfig
    splitter: SplitterSpec
    dtype: str  # numpy dtype of the output tokens
    tokenizer_backend: str = "classic"  # or "gigatoken" (gigatoken_backend), the same ids


@dataclass
class Chunk:
    """Consecutive raw lines of one file, starting at line `first_lineno`.

    A chunk with `failure` set carries no lines: it marks, in input order, the
    point where a file could not be read any further.
    """

    source: str
    first_lineno: int
    lines: list[bytes]
    nbytes: int
    failure: Rejected | None = None


@dataclass(frozen=True)
class Rejected:
    """A line that was not turned into a document: `reason` is one of the constants above."""

    source: str
    lineno: int
    reason: str
    detail: str

    def message(self) -> str:
        return f"{self.source}:{self.lineno}: {self.detail}"


@dataclass
class KeyTokens:
    """One key's documents of a chunk, back to back."""

    tokens: np.ndarray  # every token of every document
    sequence_lengths: np.ndarray  # int32, one per sequence
    document_sequences: np.ndarray  # int64, sequences per document
    document_tokens: np.ndarray  # int64, tokens per document


@dataclass
class EncodedChunk:
    """What a worker sends back for one `Chunk`."""

    source: str
    keys: dict[str, KeyTokens]
    rejected: list[Rejected]
    documents: int
    blank_lines: int
    nbytes: int
    tokens: int
    empty: dict[str, int] = field(default_factory=dict)  # documents without tokens, by key


Document = dict[str, "str | list[str]"]


@dataclass
class Encoded:
    """One key's ids for some documents, before assembly: every sentence's ids back to
    back (empty sentences included, no eod yet)."""

    tokens: np.ndarray  # the output dtype
    lengths: np.ndarray  # int64, ids per sentence
    counts: np.ndarray  # int64, sentences per document

    @staticmethod
    def join(parts: list[Encoded], dtype: np.dtype) -> Encoded:
        if not parts:
            return Encoded(np.zeros(0, dtype), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return Encoded(
            np.concatenate([p.tokens for p in parts]),
            np.concatenate([p.lengths for p in parts]),
            np.concatenate([p.counts for p in parts]),
        )


def json_type_name(value: object) -> str:
    return JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def parse_line(raw: bytes, keys: tuple[str, ...]) -> Document | tuple[str, str] | None:
    """The values of `keys` in one JSON line; (reason, detail) if unusable; None if blank."""
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return NOT_UTF8, (
            f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)"
        )
    if text.startswith("\ufeff"):  # a UTF-8 byte order mark on the first line
        text = text[1:]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return INVALID_JSON, f"invalid JSON ({err.msg} at column {err.colno})"
    except RecursionError:
        return INVALID_JSON, "invalid JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return NOT_AN_OBJECT, f"expected a JSON object, found a JSON {json_type_name(obj)}"
    document: Document = {}
    for key in keys:
        if key not in obj:
            present = ", ".join(repr(k) for k in list(obj)[:8]) or "no keys"
            more = ", ..." if len(obj) > 8 else ""
            return MISSING_KEY, f"no key {key!r} (the object has {present}{more}); see --json-keys"
        value = obj[key]
        if isinstance(value, str):
            document[key] = value
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            document[key] = value  # already split into sentences
        else:
            return NOT_A_STRING, (
                f"the value of {key!r} is a JSON {json_type_name(value)}, not a string "
                "(or a list of strings)"
            )
        # A \ud800-style escape can decode to half a surrogate pair, which no
        # tokenizer can encode (Megatron's GPT-2 crashes on it, tiktoken replaces it).
        if b"\\u" in raw and (problem := _unpaired_surrogate(document[key])):
            return BAD_UNICODE, f"the value of {key!r} has an unpaired surrogate {problem}"
    return document


def _unpaired_surrogate(value: str | list[str]) -> str | None:
    for text in [value] if isinstance(value, str) else value:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"\\u{ord(text[err.start]):04x} at character {err.start + 1} (not Unicode text)"
    return None


class DocumentEncoder:
    """Turns chunks into token arrays; one per worker process."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.tokenizer = build_tokenizer_from_config(spec.tokenizer_config)
        self.splitter: SentenceSplitter = build_splitter(spec.splitter)
        self.dtype = np.dtype(spec.dtype)
        self.eod = self.tokenizer.eod
        self.batch_encoder: BatchEncoder | None = None
        self._encoded_chars = 0
        if spec.tokenizer_backend == "gigatoken":
            self.batch_encoder = build_batch_encoder(spec.tokenizer_config)

    def encode(self, chunk: Chunk) -> EncodedChunk:
        keys = self.spec.json_keys
        if chunk.failure is not None:
            return EncodedChunk(chunk.source, self._empty_keys(), [chunk.failure], 0, 0, 0, 0)
        rejected: list[Rejected] = []
        blank = 0
        # sentences[key][d] = the sentences of accepted document d
        sentences: dict[str, list[list[str]]] = {key: [] for key in keys}
        for offset, raw in enumerate(chunk.lines):
            lineno = chunk.first_lineno + offset
            parsed = parse_line(raw, keys)
            if parsed is None:
                blank += 1
                continue
            if isinstance(parsed, tuple):
                reason, detail = parsed
                if lineno == 1 and raw.lstrip().startswith(b"["):
                    detail += "; the file looks like one JSON array: write one object per line"
                rejected.append(Rejected(chunk.source, lineno, reason, detail))
                continue
            try:
                split = {key: self._split(parsed[key]) for key in keys}
            except Exception as err:  # a splitter bug or an odd input: reject this line only
                detail = f"{SPLIT_FAILED} ({_describe(err)})"
                rejected.append(Rejected(chunk.source, lineno, SPLIT_FAILED, detail))
                continue
            for key in keys:
                sentences[key].append(split[key])
        ids, failed = self._tokenize(sentences, chunk, rejected)
        if failed:
            rejected.sort(key=lambda r: r.lineno)
        key_tokens = {key: self._assemble(ids[key]) for key in keys}
        documents = int(ids[keys[0]].counts.size) if keys else 0
        return EncodedChunk(
            source=chunk.source,
            keys=key_tokens,
            rejected=rejected,
            documents=documents,
            blank_lines=blank,
            nbytes=chunk.nbytes,
            tokens=sum(int(k.tokens.size) for k in key_tokens.values()),
            empty={key: int((k.document_tokens == 0).sum()) for key, k in key_tokens.items()},
        )

    def _split(self, value: str | list[str]) -> list[str]:
        return list(value) if isinstance(value, list) else self.splitter.split(value)

    def _tokenize(
        self,
        sentences: dict[str, list[list[str]]],
        chunk: Chunk,
        rejected: list[Rejected],
    ) -> tuple[dict[str, Encoded], bool]:
        """Token ids per key, documents back to back; one batch call per key when possible."""
        keys = self.spec.json_keys
        try:
            result = {key: self._tokenize_documents(sentences[key]) for key in keys}
            return result, False
        except Exception:
            pass
        # Some document broke the tokenizer: redo document by document, rejecting the bad ones.
        accepted_lines = self._accepted_linenos(chunk, rejected)
        parts: dict[str, list[Encoded]] = {key: [] for key in keys}
        for d, lineno in enumerate(accepted_lines):
            try:
                per_key = {key: self._tokenize_documents([sentences[key][d]]) for key in keys}
            except Exception as err:
                detail = f"the tokenizer failed ({_describe(err)})"
                rejected.append(Rejected(chunk.source, lineno, TOKENIZE_FAILED, detail))
                continue
            for key in keys:
                parts[key].append(per_key[key])
        return {key: Encoded.join(parts[key], self.dtype) for key in keys}, True

    def _tokenize_documents(self, documents: list[list[str]]) -> Encoded:
        """The ids of every sentence of `documents`, back to back."""
        counts = np.fromiter(map(len, documents), np.int64, count=len(documents))
        if self.batch_encoder is not None:
            tokens, lengths = self._batch_ids(documents, self.batch_encoder)
            return Encoded(tokens, lengths, counts)
        # One call per sentence, not tokenize_batch: batch paths start threads of
        # their own (tiktoken: a pool of 8), and one worker should use one core.
        tokenize = self.tokenizer.tokenize
        ids = [
            tokenize(sentence) if len(sentence) <= PIECE_CHARS else self._long(sentence)
            for doc in documents
            for sentence in doc
        ]
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
        if any(isinstance(piece, np.ndarray) for piece in ids):  # a long text among them
            tokens = np.concatenate([np.asarray(piece, dtype=self.dtype) for piece in ids])
        else:
            total = int(lengths.sum())
            tokens = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, count=total)
        return Encoded(tokens, lengths, counts)

    def _batch_ids(
        self, documents: list[list[str]], encode: BatchEncoder
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every sentence's ids back to back, and their lengths: the short sentences in one
        batch call (numpy arrays, no Python int per token), the long ones in pieces."""
        sentences = [sentence for doc in documents for sentence in doc]
        chars = list(map(len, sentences))
        long = [i for i, n in enumerate(chars) if n > PIECE_CHARS]
        short = [s for s in sentences if len(s) <= PIECE_CHARS] if long else sentences
        short_tokens, short_lengths = encode(short)
        self._encoded_chars += sum(chars)
        if self._encoded_chars >= GIGATOKEN_REFRESH_CHARS:
            # gigatoken caches every word it meets and never forgets: a fresh encoder
            # now and then keeps a worker's memory flat however big the corpus.
            self.batch_encoder = build_batch_encoder(self.spec.tokenizer_config)
            self._encoded_chars = 0
        short_tokens = short_tokens.astype(self.dtype, copy=False)
        short_lengths = short_lengths.astype(np.int64, copy=False)
        if not long:
            return short_tokens, short_lengths
        # The long texts' ids go in between the short ones, in sentence order.
        is_long = np.zeros(len(sentences), bool)
        is_long[long] = True
        lengths = np.zeros(len(sentences), np.int64)
        lengths[~is_long] = short_lengths
        starts = np.concatenate(([0], np.cumsum(short_lengths)))
        pieces: list[np.ndarray] = []
        done = 0  # tokens of short sentences placed so far
        for j, i in enumerate(long):
            cut = int(starts[i - j])  # i - j short sentences come before sentence i
            pieces.append(short_tokens[done:cut])
            pieces.append(self._long(sentences[i]))
            lengths[i] = pieces[-1].size
            done = cut
        pieces.append(short_tokens[done:])
        return np.concatenate(pieces), lengths

    def _long(self, text: str) -> np.ndarray:
        """A long text's ids straight into the output dtype, piece by piece: as one list
        of Python ints a 50 MB document's 12 million ids would take 500 MB."""
        parts = [
            np.asarray(ids, dtype=self.dtype) for ids in self.tokenizer.tokenize_in_pieces(text)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def _accepted_linenos(self, chunk: Chunk, rejected: list[Rejected]) -> list[int]:
        """Line numbers of the documents that were parsed and split (in order)."""
        bad = {r.lineno for r in rejected}
        return [
            chunk.first_lineno + i
            for i, raw in enumerate(chunk.lines)
            if raw.strip() and chunk.first_lineno + i not in bad
        ]

    def _assemble(self, encoded: Encoded) -> KeyTokens:
        """One key's `KeyTokens`, in numpy: sentences without ids dropped, eod (with
        --append-eod) after the last kept sentence of each document that has one."""
        lengths, counts = encoded.lengths, encoded.counts
        kept = lengths > 0
        document_of = np.repeat(np.arange(counts.size), counts)  # per sentence
        document_sequences = np.bincount(document_of[kept], minlength=counts.size)
        token_ends = np.concatenate(([0], np.cumsum(lengths)))
        sentence_ends = np.cumsum(counts)
        document_ends = token_ends[sentence_ends]  # where each document's ids end
        document_tokens = document_ends - token_ends[sentence_ends - counts]
        sequence_lengths = lengths[kept]
        tokens = encoded.tokens
        if self.spec.append_eod:
            has = document_sequences > 0
            tokens = np.insert(tokens, document_ends[has], self.eod)
            sequence_lengths[np.cumsum(document_sequences)[has] - 1] += 1
            document_tokens = document_tokens + has
        return KeyTokens(
            tokens,
            sequence_lengths.astype(np.int32),
            document_sequences.astype(np.int64),
            document_tokens.astype(np.int64),
        )

    def _empty_keys(self) -> dict[str, KeyTokens]:
        empty = Encoded.join([], self.dtype)
        return {key: self._assemble(empty) for key in self.spec.json_keys}


def _describe(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text if len(text) < 200 else text[:200] + "..."
