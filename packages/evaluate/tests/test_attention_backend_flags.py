"""mg-eval takes mg-train's attention-kernel flags: the math kernel scores as SDPA's own choice,
and a CUDA kernel on a machine without CUDA is refused in one line naming the flag (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from mg.evaluate.cli import main


def _wikitext(capsys, ckpt, data, report, *extra: str) -> tuple[int, str]:
    argv = ["wikitext", "--load", str(ckpt), "--valid-data", str(data), "--report", str(report)]
    code = main([*argv, "--micro-batch-size", "4", *extra])
    return code, capsys.readouterr().err


def test_unfused_scores_as_auto(trained, wikitext_file, tmp_path, capsys) -> None:
    _, ckpt = trained
    for name, extra in (("auto", []), ("unfused", ["--attention-backend", "unfused"])):
        code, err = _wikitext(capsys, ckpt, wikitext_file, tmp_path / f"{name}.jsonl", *extra)
        assert code == 0, err
    auto, unfused = (
        json.loads((tmp_path / f"{n}.jsonl").read_text())["metrics"] for n in ("auto", "unfused")
    )
    assert unfused["avg_loss"] == pytest.approx(auto["avg_loss"], rel=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--attention-backend", "flash"], "--attention-backend flash"), (["--use-flash-attn"], "--")],
)
def test_cuda_kernels_are_refused_by_name(trained, wikitext_file, tmp_path, capsys, flags, named):
    _, ckpt = trained
    code, err = _wikitext(capsys, ckpt, wikitext_file, tmp_path / "r.jsonl", *flags)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "CUDA" in lines[0]


def test_harness_model_takes_the_kernel(trained) -> None:
    """lm-eval's mg model (`harness` task, `--model mg --model_args attention_backend=...`):
    the math kernel gives SDPA's own choice's log-likelihoods."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from mg.evaluate.lm_eval_adapter import MgLM

    _, ckpt = trained
    requests = [
        Instance(
            "loglikelihood", doc={}, arguments=("I had been teaching", " at the school"), idx=0
        )
    ]
    auto = MgLM(load=str(ckpt), batch_size=1).loglikelihood(requests)
    unfused = MgLM(load=str(ckpt), batch_size=1, attention_backend="unfused")
    assert unfused.model.config.attention_backend == "unfused"
    assert unfused.loglikelihood(requests)[0][0] == pytest.approx(auto[0][0], rel=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_harness_refuses_cuda_kernels_by_name(trained, capsys) -> None:
    _, ckpt = trained
    argv = ["harness", "--load", str(ckpt), "--tasks", "x", "--attention-backend", "flash"]
    assert main(argv) == 2
    assert "--attention-backend flash selects a CUDA kernel" in capsys.readouterr().err
