"""The evaluated data's token ids against the model's vocabulary, before any batch runs."""

from __future__ import annotations

from torch import nn

from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_parallel import EvalModel
from mg.indexed_dataset import IndexedDatasetError, parse_data_path
from mg.indexed_dataset.token_range import check_token_ids


def real_vocab_size(model: nn.Module | EvalModel, tokenizer: BaseTokenizer) -> int:
    """The ids the model scores: its unpadded vocabulary (what the loader set on its output
    layer, `set_real_vocab_size`), else the tokenizer's (a stage without the output layer)."""
    module = model.module if isinstance(model, EvalModel) else model
    sizes = [getattr(m, "real_vocab_size", None) for m in module.modules()]
    return max([tokenizer.vocab_size, *(s for s in sizes if s)])


def check_vocabulary(
    data_path: list[str], model: nn.Module | EvalModel, tokenizer: BaseTokenizer
) -> None:
    """An id the model has no row for (data made with another tokenizer) is named up front,
    not met as an IndexError, or a padding row's -inf, in the middle of the run."""
    try:
        blend = parse_data_path(data_path)
        check_token_ids(blend.prefixes, real_vocab_size(model, tokenizer), "the model's vocabulary")
    except (ValueError, OSError, IndexedDatasetError) as exc:
        raise EvalInputError(f"--data-path {' '.join(data_path)}: {exc}") from None
