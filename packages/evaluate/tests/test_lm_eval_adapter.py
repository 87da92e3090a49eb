"""The lm-evaluation-harness model "mg": its log-likelihoods equal those of the harness's
own HFLM on the same weights exported to transformers, and `mg-eval harness` runs local
task YAMLs end to end (no network)."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

from eval_hf_reference import to_hf  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from mg.core.fixtures import fixture_path  # noqa: E402
from mg.evaluate.cli import main  # noqa: E402
from mg.evaluate.lm_eval_adapter import MgLM  # noqa: E402

TOL = 1e-4


def _import_hflm():
    """lm_eval's HFLM module imports `accelerate` at the top but, given an already built
    model on one process, never uses it. It is not a dependency here, so the import runs
    against stand-ins that fail loudly if called, removed again right after (other code
    probes for accelerate with importlib and must keep seeing it absent)."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("accelerate") is not None or "lm_eval.models.huggingface" in (
        sys.modules
    ):
        from lm_eval.models.huggingface import HFLM

        return HFLM

    def unavailable(*args, **kwargs):
        raise RuntimeError("accelerate is not installed")

    root, utils = types.ModuleType("accelerate"), types.ModuleType("accelerate.utils")
    for name in ("Accelerator", "InitProcessGroupKwargs", "find_executable_batch_size"):
        setattr(root, name, unavailable)
    utils.get_max_memory = unavailable
    root.utils = utils
    sys.modules.update({"accelerate": root, "accelerate.utils": utils})
    try:
        from lm_eval.models.huggingface import HFLM
    finally:
        del sys.modules["accelerate"], sys.modules["accelerate.utils"]
    return HFLM


def _hflm(model):
    HFLM = _import_hflm()  # noqa: N806
    from transformers import GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast(
        vocab=str(fixture_path("gpt2-bpe", "vocab.json")),
        merges=str(fixture_path("gpt2-bpe", "merges.txt")),
    )
    return HFLM(pretrained=to_hf(model), tokenizer=tokenizer, batch_size=4, device="cpu")


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def pair(memorized):
    """Our adapter and HFLM on the model that knows some passages (greedy flags vary)."""
    model, ckpt, _ = memorized
    return MgLM(load=str(ckpt), batch_size=3), _hflm(model)


def _texts(memorized) -> list[str]:
    return [json.loads(line)["text"] for line in memorized[2].read_text().splitlines()]


def test_loglikelihoods_equal_hflm(pair, memorized) -> None:
    ours, reference = pair
    texts = _texts(memorized)
    args = [(t[: t.rfind(" ")], t[t.rfind(" ") :]) for t in texts]
    args += [("", "Hello world"), ("He said ", "no. She said yes, and left the room at once.")]
    # a context longer than the model's 64 tokens is cut from the left by both
    args.append((" ".join(texts[:4]), " the end"))
    got = ours.loglikelihood(_requests("loglikelihood", args))
    expected = reference.loglikelihood(_requests("loglikelihood", args))
    assert len(got) == len(expected) == len(args)
    worst = max(abs(g[0] - e[0]) / abs(e[0]) for g, e in zip(got, expected, strict=True))
    print(f"max relative difference of loglikelihoods: {worst:.2e}")
    assert worst <= TOL
    assert [g[1] for g in got] == [e[1] for e in expected]
    assert any(g[1] for g in got) and not all(g[1] for g in got)  # the flag is tested

    docs = [" ".join(texts[:6]), texts[7]]  # the first spans several 64-token windows
    got = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]))
    expected = reference.loglikelihood_rolling(
        _requests("loglikelihood_rolling", [(d,) for d in docs])
    )
    for g, e in zip(got, expected, strict=True):
        assert g == pytest.approx(e, rel=TOL)


def test_generate_until_matches_greedy_transformers(pair, memorized) -> None:
    ours, reference = pair
    texts = _texts(memorized)
    args = [(texts[0][:30], {"until": ["."], "max_gen_toks": 12}),
            (texts[1][:25], {"until": [" the"], "max_gen_toks": 6}),
            (texts[9][:20], {"max_gen_toks": 5})]  # fmt: skip
    got = ours.generate_until(_requests("generate_until", args))
    expected = reference.generate_until(_requests("generate_until", args))
    assert got == expected
    assert all(got)


TASKS = """\
task: mg_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
---
task: mg_tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{context}}}}"
metric_list:
  - metric: word_perplexity
"""


def test_harness_command_end_to_end(memorized, tmp_path, capsys) -> None:
    """`mg-eval harness` on two local tasks; the numbers equal simple_evaluate with HFLM."""
    model, ckpt, _ = memorized
    texts = _texts(memorized)
    data = tmp_path / "tiny.jsonl"
    with data.open("w") as f:
        for i, text in enumerate(texts):
            cut = text.rfind(" ")
            wrong = [texts[(i + k) % len(texts)].split()[-1] for k in (1, 2)]
            f.write(
                json.dumps(
                    {
                        "context": text[:cut],
                        "choices": [text[cut + 1 :], *wrong],
                        "label": 0,
                    }
                )
                + "\n"
            )
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    for k, block in enumerate(TASKS.format(data=data).split("---\n")):
        (tasks_dir / f"task{k}.yaml").write_text(block)
    report = tmp_path / "r.jsonl"
    code = main(["harness", "--load", str(ckpt), "--tasks", "mg_tiny_choice,mg_tiny_rolling",
                 "--include-path", str(tasks_dir), "--report", str(report)])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "mg_tiny_choice" in out.out and "word_perplexity" in out.out
    ours = json.loads(report.read_text())["metrics"]["results"]

    from lm_eval.tasks import TaskManager

    reference = lm_eval.simple_evaluate(
        model=_hflm(model),
        tasks=["mg_tiny_choice", "mg_tiny_rolling"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=False,
    )["results"]
    assert ours["mg_tiny_choice"]["acc,none"] == reference["mg_tiny_choice"]["acc,none"]
    assert 0.5 <= ours["mg_tiny_choice"]["acc,none"] < 1.0  # 8 of 12 passages are known
    assert ours["mg_tiny_rolling"]["word_perplexity,none"] == pytest.approx(
        reference["mg_tiny_rolling"]["word_perplexity,none"], rel=TOL
    )


def test_unknown_task_is_a_clear_error(trained, capsys) -> None:
    _, ckpt = trained
    assert main(["harness", "--load", str(ckpt), "--tasks", "no_such_task_xyz"]) == 2
    err = capsys.readouterr().err
    assert "unknown lm-eval task(s) no_such_task_xyz" in err


@pytest.mark.slow
def test_python_m_lm_eval_style_entry_point(memorized, tmp_path) -> None:
    """`python -m mg.evaluate.lm_eval_adapter run --model mg ...` is lm_eval's own command
    line with "mg" registered; it gives what `mg-eval harness` gives."""
    import subprocess
    import sys

    _, ckpt, data = memorized
    (tmp_path / "tasks").mkdir()
    block = TASKS.format(data=tmp_path / "d.jsonl").split("---\n")[1]
    (tmp_path / "tasks" / "rolling.yaml").write_text(block)
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"context": t}) + "\n" for t in texts))
    result = subprocess.run(
        [sys.executable, "-m", "mg.evaluate.lm_eval_adapter", "run", "--model", "mg",
         "--model_args", f"load={ckpt}", "--tasks", "mg_tiny_rolling",
         "--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mg_tiny_rolling" in result.stdout and "word_perplexity" in result.stdout
    report = tmp_path / "r.jsonl"
    argv = ["harness", "--load", str(ckpt), "--tasks", "mg_tiny_rolling"]
    assert main([*argv, "--include-path", str(tmp_path / "tasks"), "--report", str(report)]) == 0
    ours = json.loads(report.read_text())["metrics"]["results"]["mg_tiny_rolling"]
    files = list((tmp_path / "out").rglob("results_*.json"))
    theirs = json.loads(files[0].read_text())["results"]["mg_tiny_rolling"]
    assert theirs["word_perplexity,none"] == pytest.approx(ours["word_perplexity,none"], rel=1e-6)
