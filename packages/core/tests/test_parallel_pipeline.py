"""Pipeline stages and schedules on gloo ranks against the whole model on one process.

One launch runs every scenario; this file is also the rank worker
(`python test_parallel_pipeline.py OUT_DIR` under RANK/WORLD_SIZE). Each rank
builds the whole model with the same seed (that is how the pipeline builds
it too), computes the single-process reference itself (Megatron's averaging:
the mean over micro-batches of each micro-batch's masked mean) and compares
the gradients of the parameters its chunks hold.

Tolerance (fp32): the pipeline runs the same operations on the same numbers,
only the tied embedding's two gradient halves are summed by an all-reduce
instead of autograd; losses agree to 1e-6 relative and gradients to 1e-5
relative of the largest entry.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mg.core.models import GPTModel, presets
from mg.core.parallel.pipeline import (
    PipelineConfigError,
    allreduce_shared_embedding_grad,
    global_parameter_name,
    global_state_dict,
    layer_ranges,
    load_global_state_dict,
    split_model,
    virtual_size_from_layers,
)
from mg.core.parallel.pipeline_schedule import (
    build_schedule,
    forward_only,
    interleaved_1f1b,
    one_f_one_b,
    run_schedule,
)

GRAD_RTOL = 1e-5
MBS, SEQ = 2, 16


def _micro_batches(config, num_micro: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_micro):
        tokens = torch.randint(0, config.vocab_size, (MBS, SEQ + 1), generator=g)
        mask = (torch.rand(MBS, SEQ, generator=g) > 0.25).float()
        positions = torch.arange(SEQ).expand(MBS, SEQ)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": mask,
                "position_ids": positions,
            }
        )
    return out


def _forward_step(chunk, inp, batch):
    first = inp if inp is not None else batch["tokens"]
    labels = batch["labels"] if chunk.is_last else None
    return chunk(first, batch["position_ids"], None, labels)


def _scenario(name: str, preset: str, num_layers: int, chunks: int, num_micro: int) -> dict:
    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    config = getattr(presets, preset)(
        num_layers=num_layers, attention_dropout=0.0, hidden_dropout=0.0
    )
    torch.manual_seed(5)
    reference = GPTModel(config)
    torch.manual_seed(5)
    my_chunks = split_model(GPTModel(config), rank, size, chunks)
    batches = _micro_batches(config, num_micro, seed=17)
    ref_loss = 0.0
    for batch in batches:
        losses = reference(batch["tokens"], labels=batch["labels"])
        micro = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        (micro / num_micro).backward()
        ref_loss += float(micro) / num_micro

    def loss_func(per_token, batch):
        mask = batch["loss_mask"]
        micro = (per_token * mask).sum() / mask.sum()
        return micro / num_micro, float(micro)

    actions = build_schedule(num_micro, rank, size, chunks)
    result = run_schedule(
        actions,
        my_chunks,
        batches,
        forward_step=_forward_step,
        loss_func=loss_func,
        group=group,
        tensor_shape=(MBS, SEQ, config.hidden_size),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    embedding_group = dist.new_group([0, size - 1])
    allreduce_shared_embedding_grad(my_chunks, embedding_group)
    reference_params = dict(reference.named_parameters())
    grad_diff, checked = 0.0, 0
    for chunk in my_chunks:
        for local, p in chunk.named_parameters():
            global_name = global_parameter_name(chunk, local) or "embedding.word_embeddings.weight"
            q = reference_params[global_name]
            grad_diff = max(
                grad_diff, float((p.grad - q.grad).abs().max()) / float(q.grad.abs().max())
            )
            checked += 1
    # forward only (evaluation order) gives the same per-micro-batch losses
    with torch.no_grad():
        evaluated = run_schedule(
            forward_only(actions),
            my_chunks,
            batches,
            forward_step=_forward_step,
            loss_func=loss_func,
            group=group,
            tensor_shape=(MBS, SEQ, config.hidden_size),
            dtype=torch.float32,
            device=torch.device("cpu"),
            backward=False,
        )
    # whole-model names round trip: gather every rank's tensors, load into a fresh split
    gathered: list[dict] = [None] * size  # type: ignore[list-item]
    dist.all_gather_object(gathered, global_state_dict(my_chunks))
    full = {k: v for part in gathered for k, v in part.items()}
    torch.manual_seed(99)
    fresh = split_model(GPTModel(config), rank, size, chunks)
    load_global_state_dict(fresh, full)
    roundtrip = max(
        float((a - b).abs().max())
        for f, c in zip(fresh, my_chunks, strict=True)
        for a, b in zip(f.state_dict().values(), c.state_dict().values(), strict=True)
    )
    return {
        "name": name,
        "last": rank == size - 1,
        "loss": sum(result.loss_terms) / num_micro if result.loss_terms else None,
        "eval_loss": sum(evaluated.loss_terms) / num_micro if evaluated.loss_terms else None,
        "ref_loss": ref_loss,
        "grad_diff": grad_diff,
        "checked": checked,
        "total_params": len(reference_params),
        "full_keys": sorted(full) == sorted(reference.state_dict()),
        "roundtrip": roundtrip,
    }


SCENARIOS = [
    ("1f1b tied gpt2", "tiny_gpt2", 4, 1, 4),
    ("1f1b untied llama m=3", "tiny_llama", 4, 1, 3),
    ("interleaved v=2 tied gpt2", "tiny_gpt2", 4, 2, 4),
    ("interleaved v=2 untied llama", "tiny_llama", 8, 2, 6),
]


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    results = [_scenario(*s) for s in SCENARIOS]
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    from mg.core.testing.launch import launch_workers

    out = tmp_path_factory.mktemp("pp")
    launch_workers(__file__, 2, [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[s[0] for s in SCENARIOS])
def test_pipeline_equals_one_process(results, index: int) -> None:
    ranks = [r[index] for r in results]
    last = next(r for r in ranks if r["last"])
    assert last["loss"] == pytest.approx(last["ref_loss"], rel=1e-6)
    assert last["eval_loss"] == pytest.approx(last["ref_loss"], rel=1e-6)
    for r in ranks:
        assert r["grad_diff"] < GRAD_RTOL, r
        assert r["full_keys"] and r["roundtrip"] == 0.0, r
    # every parameter of the whole model is held by some rank (tied copy counted twice)
    assert sum(r["checked"] for r in ranks) >= ranks[0]["total_params"]


def test_layer_assignment_is_megatrons() -> None:
    assert layer_ranges(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert layer_ranges(4, 4) == [[(0, 1)], [(1, 2)], [(2, 3)], [(3, 4)]]
    assert virtual_size_from_layers(8, 2, 2) == 2
    with pytest.raises(PipelineConfigError, match="divisible by the pipeline parallel size"):
        layer_ranges(6, 4)
    with pytest.raises(PipelineConfigError, match="num-layers-per-virtual-pipeline-stage"):
        virtual_size_from_layers(8, 2, 3)
    with pytest.raises(PipelineConfigError, match="not divisible by pipeline-model-parallel-size"):
        interleaved_1f1b(3, 0, 2, 2)


def _simulate(schedules: list[list], fwd: float = 1.0, bwd: float = 2.0) -> float:
    """Makespan of per-rank action lists with zero-latency messages; raises on deadlock."""
    size, chunks = len(schedules), 1 + max(c for s in schedules for _, c, _ in s)
    last = size * chunks - 1
    done: dict[tuple, float] = {}
    clock, pos = [0.0] * size, [0] * size
    while any(pos[r] < len(schedules[r]) for r in range(size)):
        progressed = False
        for r in range(size):
            if pos[r] == len(schedules[r]):
                continue
            kind, c, m = schedules[r][pos[r]]
            stage = c * size + r
            deps: list[tuple] = []
            if kind == "F" and stage > 0:
                deps.append(("F", stage - 1, m))
            if kind == "B":
                deps.append(("F", stage, m))
                if stage < last:
                    deps.append(("B", stage + 1, m))
            if all(d in done for d in deps):
                ready = max([clock[r], *(done[d] for d in deps)])
                clock[r] = ready + (fwd if kind == "F" else bwd)
                done[(kind, stage, m)] = clock[r]
                pos[r] += 1
                progressed = True
        assert progressed, "schedule deadlocks"
    return max(clock)


@pytest.mark.parametrize("size,chunks,num_micro", [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_schedules_are_complete_and_match_the_bubble_theory(size, chunks, num_micro) -> None:
    schedules = [build_schedule(num_micro, r, size, chunks) for r in range(size)]
    for s in schedules:
        assert sorted(s) == sorted(
            (k, c, m) for k in "FB" for c in range(chunks) for m in range(num_micro)
        )
        assert all(s.index(("F", c, m)) < s.index(("B", c, m)) for _, c, m in s)
    # with t_b = 2 t_f per chunk, the makespan is ideal · (1 + bubble), where the bubble is
    # (p−1)/m for 1F1B and (p−1)/(v·m) interleaved (Narayanan et al. 2021)
    per_chunk = 3.0 / chunks
    ideal = num_micro * chunks * per_chunk
    makespan = _simulate(schedules, 1.0 / chunks, 2.0 / chunks)
    assert makespan == pytest.approx(ideal + (size - 1) * per_chunk)
    if chunks == 1:
        assert schedules[0][: size - 1] == one_f_one_b(num_micro, 0, size)[: size - 1]


if __name__ == "__main__":
    _worker(sys.argv[1])
