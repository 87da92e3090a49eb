"""Speculative decoding with the served model's own MTP layer (mtp_draft.MTPDrafter): greedy
tokens equal plain greedy decoding under every schedule the engine has (one batch, chunked
prompts, preemption, prefix caching off), the MTP draft computes what the model's MTP block
computes, and the acceptance rate is reported."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.mtp import roll_left
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.mtp_draft import MTPDrafter
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

NEW_TOKENS = 24
VOCAB = 64


def _progressions(count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Token sequences x_{i+1} = x_i + step (mod VOCAB), step 1..3: a pattern an MTP head
    learns in a few hundred steps (token i + 2 follows from i + 1 and the step)."""
    starts = torch.randint(0, VOCAB, (count, 1), generator=gen)
    steps = torch.randint(1, 4, (count, 1), generator=gen)
    return (starts + steps * torch.arange(length)) % VOCAB


def _model(trained: bool) -> GPTModel:
    """A tiny Llama with one MTP depth, random, or trained with its MTP loss (Megatron's
    objective, factor 1) on `_progressions` so that its MTP guesses are worth checking."""
    config = presets.tiny_llama(
        num_layers=2, vocab_size=VOCAB, max_position_embeddings=128, seq_length=32,
        mtp_num_layers=1, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = GPTModel(config)
    if trained:
        gen = torch.Generator().manual_seed(4)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(300):
            batch = _progressions(16, 33, gen)
            ids, labels = batch[:, :-1], batch[:, 1:]
            main, mtp = model(ids, labels=labels, return_mtp=True)
            mask = torch.ones_like(labels, dtype=torch.float32)
            loss = main.mean() + sum(mtp.depth_means(mask))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [_progressions(1, n, gen)[0].tolist() for n in (5, 17, 33, 9)]


def _generate(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    results = generate_batch(engine, prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.tokens for r in results]


SCHEDULES = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "preemption": {"num_blocks": 20, "block_size": 4},
    "no-prefix-caching": {"prefix_caching": False},
}


@pytest.fixture(scope="module")
def trained() -> GPTModel:
    return _model(trained=True)


@pytest.mark.slow  # training the MTP head: ~30 s
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_mtp_speculative_decoding_gives_the_greedy_tokens(trained, schedule: str) -> None:
    model = trained
    prompts = _prompts()
    plain = GenerationEngine(ModelRunner(model, 4, 128), lambda ids: "", VOCAB)
    try:
        expected = _generate(plain, prompts)
    finally:
        plain.shutdown()
    options = dict(SCHEDULES[schedule])
    pool = {
        "num_blocks": options.pop("num_blocks", None),
        "block_size": options.pop("block_size", 16),
    }
    runner = ModelRunner(model, 4, 128, **pool)
    drafter = MTPDrafter(
        runner, vocab_size=VOCAB, catch_up_tokens=options.get("max_num_batched_tokens", 64)
    )
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, drafter=drafter, **options)
    try:
        assert _generate(engine, prompts) == expected
        stats = engine.stats
        rate = stats.accepted_draft_tokens / max(stats.draft_tokens, 1)
        print(
            f"{schedule}: {stats.accepted_draft_tokens}/{stats.draft_tokens} MTP draft tokens "
            f"accepted ({rate:.0%}), {stats.steps} steps for {stats.generated_tokens} tokens"
        )
        assert stats.draft_tokens > 0
        if schedule == "default":  # the trained MTP head guesses most tokens right
            assert stats.accepted_draft_tokens > 0.5 * stats.draft_tokens
            assert stats.steps < stats.generated_tokens // 2
        if schedule == "preemption":
            assert stats.preemptions > 0
        assert engine.blocks.num_used == 0
    finally:
        engine.shutdown()
        drafter.close()


def test_the_draft_is_the_mtp_blocks_prediction() -> None:
    """Each guess is the argmax of the model's MTP depth-1 logits at the position before the
    sequence's last token: what `forward(return_mtp=True)` scores in training; with a
    random model's guesses the tokens are still plain greedy decoding's."""
    model = _model(trained=False)
    prompt = _prompts()[1]
    guesses: list[tuple[list[int], int]] = []

    class RecordingDrafter(MTPDrafter):
        def propose(self, work):
            super().propose(work)
            guesses.extend((list(s.tokens), s.draft[0]) for s, _ in work if s.draft)

    plain = GenerationEngine(ModelRunner(model, 1, 128), lambda ids: "", VOCAB)
    try:
        expected = _generate(plain, [prompt])
    finally:
        plain.shutdown()
    runner = ModelRunner(model, 1, 128)
    drafter = RecordingDrafter(runner, vocab_size=VOCAB, catch_up_tokens=64)
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, drafter=drafter)
    try:
        assert _generate(engine, [prompt]) == expected  # a random MTP head: same tokens
    finally:
        engine.shutdown()
        drafter.close()
    assert len(guesses) >= 6
    for tokens, guess in guesses[:6]:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            positions = torch.arange(len(tokens)).unsqueeze(0)
            hidden = model.run_decoder(model.embedding(ids, positions), positions, None)
            rotary = model.rotary_pos_emb(positions)
            embedded = model.embedding(roll_left(ids), roll_left(positions))
            depth = model.mtp.layers[0](hidden, embedded, rotary, None)
            logits = model.output_and_loss(depth, None)[0]
        assert int(logits[len(tokens) - 2, :VOCAB].argmax()) == guess


@pytest.mark.slow  # trains the MTP head (the module's fixture) and starts mg-serve
def test_mg_serve_drafts_with_the_mtp_layer(trained, tmp_path) -> None:
    """`mg-serve --num-speculative-tokens 1` on a checkpoint with an MTP layer: greedy
    completions continue the progression, and /metrics counts the accepted MTP drafts."""
    import re
    import subprocess
    import sys

    import httpx

    from mg.core.checkpoint import save_model
    from mg.core.tokenizers import TokenizerConfig

    folder = tmp_path / "mtp-model"
    save_model(folder, trained, trained.config, TokenizerConfig("NullTokenizer", vocab_size=63))
    serve = [sys.executable, "-c", "from mg.generate_server.cli import main; main()"]
    flags = ["--port", "0", "--log-level", "warning", "--num-threads", "1"]
    proc = subprocess.Popen(
        [*serve, "--load", str(folder), *flags, "--num-speculative-tokens", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + (proc.stdout.read() if proc.poll() is not None else "")
        assert "draft its MTP layer x 1 tokens" in line
        url = match.group(1)
        body = {"prompt": "0 2 4 6 8", "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].split() == [str(10 + 2 * i) for i in range(12)]
        metrics = httpx.get(url + "/metrics").text
        drafted = float(
            re.search(r"^mg_serve_spec_decode_draft_tokens_total (\S+)$", metrics, re.M)[1]
        )
        accepted = float(
            re.search(r"^mg_serve_spec_decode_accepted_tokens_total (\S+)$", metrics, re.M)[1]
        )
        print(f"mg-serve: {accepted:.0f}/{drafted:.0f} MTP draft tokens accepted")
        assert drafted > 0 and accepted >= 0.5 * drafted
    finally:
        proc.terminate()
        proc.wait(timeout=30)
