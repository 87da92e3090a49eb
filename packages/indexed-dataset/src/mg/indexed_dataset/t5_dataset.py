"""T5 span corruption (Megatron-Core's T5MaskedWordPieceDataset).

Consecutive sentences of one document are joined and cut to the target
length; ~15% of the words are chosen in spans (N-gram lengths geometric with
p = 0.2, at most 10 words: `MaskingConfig.t5()`). Each span is replaced in the
encoder input by the next sentinel `<extra_id_k>`; the decoder reads
`<bos> <extra_id_0> span0 <extra_id_1> span1 ...` and predicts the same
shifted by one, ending in `<eos>`.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from mg.indexed_dataset.masking import MaskedWordPieceDataset, MaskingConfig


class T5Dataset(MaskedWordPieceDataset):
    """Dict samples: text_enc, text_dec, labels, loss_mask, truncated, enc_mask,
    dec_mask — Megatron's keys and values. The tokenizer needs bos, eos and
    `additional_special_tokens_ids` (the sentinels: `--vocab-extra-ids 100`)."""

    reserved_tokens = 2  # <bos> and <eos>

    def __init__(self, *args, decoder_sequence_length: int, **kwargs) -> None:
        self.decoder_sequence_length = decoder_sequence_length
        super().__init__(*args, **kwargs)
        if not list(self.tokenizer.additional_special_tokens_ids):
            raise ValueError(
                "T5Dataset needs sentinel tokens <extra_id_*>; build the tokenizer with "
                "--vocab-extra-ids (e.g. 100)"
            )

    @classmethod
    def default_masking(cls) -> MaskingConfig:
        return MaskingConfig.t5()

    def _replacement(self, rng: np.random.RandomState) -> int | None:
        return self.tokenizer.mask  # the encoder sees sentinels anyway

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        sentences, target, rng = self._sentences(idx)
        tokens = [t for s in sentences for t in s]
        truncated = len(tokens) > target
        tokens = tokens[:target]
        masked = self._mask(tokens, target, rng)

        tok = self.tokenizer
        sentinels = deque(tok.additional_special_tokens_ids)
        encoder, decoder_in, decoder_out = [], [tok.bos], []
        start = 0
        for positions, labels in masked.spans:
            if not sentinels:
                raise ValueError(
                    f"sample {idx} has more masked spans than sentinel tokens "
                    f"({len(tok.additional_special_tokens_ids)}); raise --vocab-extra-ids"
                )
            sentinel = sentinels.popleft()
            encoder += [*masked.tokens[start : positions[0]], sentinel]
            decoder_in += [sentinel, *labels]
            decoder_out += [sentinel, *labels]
            start = positions[-1] + 1
        encoder += masked.tokens[start:]
        decoder_out.append(tok.eos)

        pad = self.pad_token_id
        enc_len, dec_len = self.sequence_length, self.decoder_sequence_length
        if len(encoder) > enc_len or len(decoder_in) > dec_len:
            raise ValueError(
                f"sample {idx}: {len(encoder)} encoder / {len(decoder_in)} decoder tokens do "
                f"not fit --encoder-seq-length {enc_len} / --decoder-seq-length {dec_len}"
            )
        text_enc = np.full(enc_len, pad, dtype=np.int64)
        text_enc[: len(encoder)] = encoder
        text_dec = np.full(dec_len, pad, dtype=np.int64)
        text_dec[: len(decoder_in)] = decoder_in
        enc_mask = (text_enc != pad).astype(np.int64)
        dec_mask = (text_dec != pad).astype(np.int64)
        labels = np.full(dec_len, -1, dtype=np.int64)
        labels[: len(decoder_out)] = decoder_out
        loss_mask = np.zeros(dec_len, dtype=np.int64)
        loss_mask[: len(decoder_in)] = 1
        for array in (text_enc, text_dec, labels):
            array[array == pad] = 0  # the embedding must be able to look padding up
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": enc_mask,
            "dec_mask": dec_mask,
        }
