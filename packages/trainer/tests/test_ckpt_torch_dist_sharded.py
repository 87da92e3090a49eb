"""torch_dist with the distributed optimizer: each rank writes and reads only its own shards.

One 4-rank launch (torch_dist_probe_worker.py) trains a tiny Llama shape (GQA,
SwiGLU, RMSNorm, RoPE, untied) for 10 iterations, saving at iteration 5:

- saved at TP=2 x PP=2 x DP=1 with the distributed optimizer, resumed at
  TP=1 x PP=1 x DP=4 and at TP=2 x PP=1 x DP=2 (distributed optimizer);
- saved at TP=1 x PP=2 x DP=2 (the data-parallel sharding of the flat state
  really cut; --async-save), resumed in one process into plain AdamW;
- the tied-embedding variant saved at TP=1 x PP=2 x DP=2 (the last stage's copy
  of the embedding is left to the first stage), resumed at TP=2 x DP=2;
- a wider model (memory probe) trained 2 iterations at DP=4, saved, and
  resumed at TP=2 x DP=2.

Iterations 6-10 equal the uninterrupted single-process run's (fp32, 1e-5
relative, as test_dist_opt_tp.py: only the order of floating-point sums
changes). The probe checks that no save or resume called the gather path and
records each rank's peak resident memory during the save; see
`test_no_rank_gathers_and_the_save_stays_within_its_state`.

The launch takes minutes on a small shared machine: the module's tests have a
longer timeout than the default.

A second, 2-rank test: PP=2 with dropout, 5 + save + load + 5 iterations equal
10 straight (the per-position generators stored as Megatron's rng_state objects).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from mg.core.checkpoint.megatron_sharded_keys import KeyLayout, megatron_sharded_key
from mg.core.testing.launch import launch_workers

PROBE_WORKER = Path(__file__).with_name("torch_dist_probe_worker.py")
DDP_WORKER = Path(__file__).with_name("ddp_worker.py")
RTOL = 1e-5
ITERS, SAVED_AT = 10, 5
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
LLAMA = [
    *("--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64"),
    *("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4"),
    *("--position-embedding-type", "rope", "--disable-bias-linear"),
]
UNTIED = ["--untie-embeddings-and-output-weights"]
DIST_OPT = ["--use-distributed-optimizer"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]
STOP = ["--save-interval", str(SAVED_AT), "--exit-interval", str(SAVED_AT)]
pytestmark = pytest.mark.timeout(1500)  # the shared launch, on a small shared machine
# The memory probe's model: ~6.4M parameters, so its state (tens of MB per rank)
# stands above the process's resident-memory noise.
WIDE = ["--hidden-size", "512", "--ffn-hidden-size", "1536", "--train-iters", "2"]


def _mock_argv(*args, **kwargs) -> list[str]:
    """conftest's tiny-GPT flags (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "_sharded_conftest", Path(__file__).with_name("conftest.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._mock_argv(*args, **kwargs)


def _layout(tp: int = 1, pp: int = 1) -> list[str]:
    """A layout's flags; the padded vocabulary is 128 at every TP (divisor x TP)."""
    return [
        *("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)),
        *("--make-vocab-size-divisible-by", str(128 // tp)),
    ]


def _close(reference: list[float], got: list[float], what: str) -> None:
    assert len(reference) == len(got), (what, reference, got)
    for a, b in zip(reference, got, strict=True):
        assert abs(a - b) <= RTOL * abs(a), (what, reference, got)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("sharded")
    base = _mock_argv(tmp, *NO_DROPOUT, *TORCH_DIST, mbs=2, gbs=8, iters=ITERS)
    base += ["--lr-decay-iters", str(ITERS)]
    untied, tied = [*base, *LLAMA, *UNTIED], [*base, *LLAMA]
    ckpt = {name: str(tmp / name) for name in ("tp2pp2", "pp2dp2", "tied", "wide")}
    argvs = {
        "save tp2 pp2": [*untied, *_layout(2, 2), *DIST_OPT, "--save", ckpt["tp2pp2"], *STOP],
        "tp2 pp2 -> dp4": [*untied, *_layout(), *DIST_OPT, "--load", ckpt["tp2pp2"]],
        "tp2 pp2 -> tp2 dp2": [*untied, *_layout(2), *DIST_OPT, "--load", ckpt["tp2pp2"]],
        # an async save at the end of training (the LR schedule is fixed by --lr-decay-iters)
        "save pp2 dp2": [
            *untied,
            *_layout(1, 2),
            *DIST_OPT,
            *("--save", ckpt["pp2dp2"], "--train-iters", str(SAVED_AT), "--async-save"),
        ],
        "save tied pp2 dp2": [*tied, *_layout(1, 2), *DIST_OPT, "--save", ckpt["tied"], *STOP],
        "tied pp2 dp2 -> tp2 dp2": [*tied, *_layout(2), *DIST_OPT, "--load", ckpt["tied"]],
        "wide dp4": [*untied, *WIDE, *_layout(), *DIST_OPT, "--save", ckpt["wide"]],
        "wide dp4 -> tp2 dp2": [*untied, *WIDE, *_layout(2), *DIST_OPT, "--load", ckpt["wide"]],
    }
    out = tmp / "four.json"
    launch_workers(str(PROBE_WORKER), 4, [str(out), json.dumps(list(argvs.values()))], 900)
    done = json.loads(out.read_text())
    runs = dict(zip(argvs, done["runs"], strict=True))
    return {"runs": runs, "probes": done["probes"], "ckpt": ckpt, "untied": untied, "tied": tied}


def test_tp2_pp2_checkpoint_resumes_at_dp4_and_at_tp2_dp2(four, train) -> None:
    one = train([*four["untied"], *_layout()])
    runs = four["runs"]
    _close(one.losses[:SAVED_AT], runs["save tp2 pp2"]["losses"], "save tp2 pp2")
    _close(one.losses[SAVED_AT:], runs["tp2 pp2 -> dp4"]["losses"], "-> dp4")
    _close(one.losses[SAVED_AT:], runs["tp2 pp2 -> tp2 dp2"]["losses"], "-> tp2 dp2")


def test_pp2_dp2_checkpoint_resumes_into_plain_adamw(four, train) -> None:
    one = train([*four["untied"], *_layout()])
    plain = train([*four["untied"], *_layout(), "--load", four["ckpt"]["pp2dp2"]])
    _close(one.losses[:SAVED_AT], four["runs"]["save pp2 dp2"]["losses"], "save pp2 dp2")
    _close(one.losses[SAVED_AT:], plain.losses, "-> plain AdamW")


def test_tied_embedding_checkpoint_resumes_at_tp2_dp2(four, train) -> None:
    one = train([*four["tied"], *_layout()])
    runs = four["runs"]
    _close(one.losses[:SAVED_AT], runs["save tied pp2 dp2"]["losses"], "save tied")
    _close(one.losses[SAVED_AT:], runs["tied pp2 dp2 -> tp2 dp2"]["losses"], "-> tp2 dp2")


def test_state_is_stored_by_name_in_global_shapes_and_chunked(four) -> None:
    """The model under Megatron-Core's keys (layers stacked along a leading axis); the
    optimizer's state stays `optimizer.state.<global name>.<key>` with the parameter's
    global shape (what the plain optimizer and mg-convert read); a DP=2 save wrote it in
    pieces; each pipeline stage's generators are Megatron's `rng_state` objects."""
    folder = Path(four["ckpt"]["pp2dp2"], f"iter_{SAVED_AT:07d}")
    keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    num_layers = keys["decoder.layers.mlp.linear_fc1.weight"].size[0]
    for name in (
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
    ):
        sharded = megatron_sharded_key(name, KeyLayout(num_layers))
        model = keys[sharded.key].size[sharded.prepend_axis_num :]
        for moment in ("exp_avg", "exp_avg_sq"):
            stored = keys[f"optimizer.state.{name}.{moment}"]
            assert stored.size == model, name
            covered = sum(c.sizes.numel() for c in stored.chunks)
            assert covered == model.numel(), name  # every element once
        assert f"optimizer.state.{name}.step" in keys
    fc1 = keys["optimizer.state.decoder.layers.1.mlp.linear_fc1.weight.exp_avg"]
    assert len(fc1.chunks) > 1  # the data-parallel ranks' fragments, not one gathered tensor
    assert "rng_state/shard_0.0_2.1" in keys and "rng_state/shard_1.0_2.1" in keys


def test_no_rank_gathers_and_the_save_stays_within_its_state(four) -> None:
    """No torch_dist save or resume calls the gather path or any all-gather collective.

    Memory, for the wide model (~61 MiB of training state per rank at DP=4): each
    rank's peak resident set during the save and during the resume (at TP=2 x DP=2)
    above its resident set just before, against the rank's training state, and the
    same for the gathering `state_dict()` (the torch format's path) for contrast.
    Printed for the record; the save must stay within 10% of the training state."""
    events = [e for rank in four["probes"] for e in rank]
    assert any(e["event"] == "save" and e["distributed_optimizer"] for e in events)
    assert any(e["event"] == "resume" and e["distributed_optimizer"] for e in events)
    for event in events:
        if event["event"] in ("save", "resume"):
            assert event["gathers"] == 0, event
    for rank, probes in enumerate(four["probes"]):
        save, gathered, resume = probes[-3:]  # the wide runs: save, state_dict(), resume
        assert (save["event"], gathered["event"], resume["event"]) == (
            "save",
            "state_dict",
            "resume",
        )
        if save["peak_kib"] is None:
            pytest.skip("this kernel does not let a process reset its peak RSS")
        state = save["state_bytes"]
        grew = {e["event"]: (e["peak_kib"] - e["rss_kib"]) * 1024 for e in probes[-3:]}
        print(
            f"rank {rank}: training state {state / 2**20:.1f} MiB; peak RSS above the "
            f"resident set during the torch_dist save +{grew['save'] / 2**20:.2f} MiB "
            f"({100 * grew['save'] / state:.2f}%), resume at TP=2 x DP=2 "
            f"+{grew['resume'] / 2**20:.2f} MiB (state {resume['state_bytes'] / 2**20:.1f} "
            f"MiB); gathering state_dict() +{grew['state_dict'] / 2**20:.1f} MiB"
        )
        assert grew["save"] <= 0.1 * state, (rank, grew, state)
