"""An lm-evaluation-harness (0.4.x) model for mg GPT checkpoints, registered as ``mg``.

    import mg.evaluate.lm_eval_adapter  # registers "mg"
    lm_eval.simple_evaluate(model="mg", model_args="load=ckpt", tasks=["lambada_openai"])

or from the shell, ``mg-eval harness --load ckpt --tasks lambada_openai`` and
``python -m mg.evaluate.lm_eval_adapter run --model mg --model_args load=ckpt ...``
(lm_eval's own command line, with ``mg`` registered first).

Scoring is the one of every mg-eval task (:func:`mg.evaluate.scoring.score_sequences`):
batched, and under torchrun shared out over the ranks and gathered, so the
harness sees every result on every rank (it is handed all requests; lm_eval's
own request sharding stays off). Inputs longer than the context are cut from
the left, as the harness's HFLM does. Generation is greedy.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from mg.core.models.core_attention import set_attention_backend
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_loading import load_for_eval
from mg.evaluate.scoring import Scored, score_sequences

DEFAULT_BATCH_SIZE = 8


def _batch_size(value: Any) -> int:
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE  # no memory probing: the micro-batch of mg-eval
    size = int(value)
    if size < 1:
        raise EvalInputError(f"batch_size {value!r} must be >= 1")
    return size


class MgLM(TemplateLM):
    """model_args: ``load`` (checkpoint folder, required), ``ckpt_step``, ``max_length``
    (default: the checkpoint's seq_length), ``max_gen_toks`` (256), and the tokenizer
    overrides ``tokenizer_type``, ``vocab_file``, ``merge_file``, ``tokenizer_model``."""

    def __init__(
        self,
        load: str | None = None,
        ckpt_step: int | str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        tokenizer_type: str | None = None,
        vocab_file: str | None = None,
        merge_file: str | None = None,
        tokenizer_model: str | None = None,
        attention_backend: str = "auto",
        **_harness_extras: Any,  # device, max_batch_size: set by simple_evaluate
    ) -> None:
        super().__init__()
        if not load:
            raise EvalInputError("the mg model needs model_args load=CHECKPOINT_DIR")
        step = None if ckpt_step in (None, "") else ckpt_step
        step = step if step in (None, "release") else int(step)
        overrides = dict(
            tokenizer_type=tokenizer_type,
            vocab_file=vocab_file,
            merge_file=merge_file,
            tokenizer_model=tokenizer_model,
        )
        loaded = load_for_eval(load, step, overrides)
        set_attention_backend(loaded.model, attention_backend, loaded.config)
        self.model = loaded.model
        self.mg_tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(max_length or loaded.config.seq_length)
        if (
            loaded.config.position_embedding_type == "learned_absolute"
            and self.max_length > loaded.config.max_position_embeddings
        ):
            raise EvalInputError(
                f"max_length {self.max_length} exceeds the model's max_position_embeddings "
                f"{loaded.config.max_position_embeddings}"
            )
        self.max_gen_toks = int(max_gen_toks)

    # tokenization -------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.mg_tokenizer.eod

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        return list(self.mg_tokenizer.tokenize(string))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.mg_tokenizer.detokenize(list(tokens))

    # scoring ------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_
    ) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation, and whether greedy decoding
        gives it; the sequence is cut to its last max_length + 1 tokens."""
        items = []
        for _key, context, continuation in requests:
            if not continuation:
                raise EvalInputError("an empty continuation has no log-likelihood to score")
            tokens = (context + continuation)[-(self.max_length + 1) :]
            scored = min(len(continuation), len(tokens) - 1)
            items.append(Scored(tokens, [0] * (len(tokens) - 1 - scored) + [1] * scored))
        scores = score_sequences(self.model, items, self.batch_size, desc="lm-eval")
        return [(-s.loss_sum, s.all_correct) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of max_length tokens (the
        first conditioned on the end-of-text token), as the harness's HFLM does."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _greedy) in zip(
            owners, self._loglikelihood_tokens(windows), strict=True
        ):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation until one of ``until`` (default: end of text) or
        ``max_gen_toks`` tokens; the stop string is cut off, as in HFLM."""
        device = next(self.model.parameters()).device
        out = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise EvalInputError("the mg model generates greedily; do_sample is not supported")
            eot_text = self.tok_decode([self.eot_token_id])
            until = until + [eot_text]
            tokens = self.tok_encode(context)
            generated: list[int] = []
            text = ""
            for _ in range(max_new):
                window = (tokens + generated)[-self.max_length :]
                logits = self.model(torch.tensor([window], device=device))
                next_id = int(logits[0, -1].argmax())
                if next_id == self.eot_token_id:
                    break
                generated.append(next_id)
                text = self.tok_decode(generated)
                if any(stop in text for stop in until):
                    break
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", request.args, text)
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line with the ``mg`` model registered."""
    # lazy: lm-eval's own command line (its evaluator, loggers) only for the `run` entry
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    # run as a script: let the importable module register "mg" (registering this
    # __main__ copy too would be a second class under the same name)
    from mg.evaluate.lm_eval_adapter import main as registered_main

    registered_main()
else:
    register_model("mg")(MgLM)
