"""Tensor and sequence parallelism for BertModel and T5Model on 2 gloo ranks vs one process.

This file is also the rank worker (`python test_parallel_tensor_bert_t5.py OUT_DIR`
under RANK/WORLD_SIZE/MASTER_*). Each rank builds the full model (same seed),
keeps an unsharded copy as the reference, shards the other with
`apply_tensor_parallel` (TP=2) and compares, on padded batches: the masked-LM
loss, BERT's binary logits, every gradient (gathered from its shards) and the
global gradient norm. BERT is covered pre-LN (Megatron's), post-LN (imported
HF weights) and with an untied output layer; T5 tied and untied. Tolerances as
in test_parallel_tensor.py: only the order of floating-point sums changes.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mg.core.models import TransformerConfig
from mg.core.models.bert import BertModel
from mg.core.models.t5 import T5Model
from mg.core.parallel import ParallelDims
from mg.core.parallel.grad_norm import clip_grad_norm
from mg.core.parallel.tensor_parallel import apply_tensor_parallel, sync_tensor_parallel_grads
from mg.core.testing.launch import launch_workers

WORLD = 2
SHAPE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    vocab_size=64,
    seq_length=12,
    max_position_embeddings=16,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
SCENARIOS = {
    "bert-pre_ln-sp": ("bert", {}, True),
    "bert-pre_ln": ("bert", {}, False),
    "bert-post_ln-sp": ("bert", {"transformer_layer_order": "post_ln"}, True),
    "bert-untied": ("bert", {"untie_embeddings_and_output_weights": True}, False),
    "t5-sp": ("t5", {"kv_channels": 16}, True),
    "t5-untied": ("t5", {"untie_embeddings_and_output_weights": True}, False),
}
RTOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model: torch.nn.Module, family: str, batch: dict) -> tuple[torch.Tensor, list[float]]:
    if family == "bert":
        per_token, binary = model(
            batch["ids"], batch["mask"], batch["types"], lm_labels=batch["labels"]
        )
        lm = (per_token * batch["mask"]).sum() / batch["mask"].sum()
        return lm + binary.float().logsumexp(-1).mean(), binary.flatten().tolist()
    per_token = model(
        batch["ids"],
        batch["dec"],
        batch["mask"],
        batch["dec_mask"],
        batch["mask"],
        lm_labels=batch["dec_labels"],
    )
    return (per_token * batch["dec_mask"]).sum() / batch["dec_mask"].sum(), []


def _batch() -> dict:
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -5:] = 0
    dec_mask = torch.ones(2, 8, dtype=torch.long)
    dec_mask[1, -3:] = 0
    return {
        "ids": torch.randint(1, 64, (2, 12), generator=g),
        "types": (torch.arange(12) >= 6).long().expand(2, 12),
        "labels": torch.randint(0, 64, (2, 12), generator=g),
        "mask": mask,
        "dec": torch.randint(1, 64, (2, 8), generator=g),
        "dec_labels": torch.randint(0, 64, (2, 8), generator=g),
        "dec_mask": dec_mask,
    }


def _scenario(family: str, overrides: dict, sp: bool) -> dict:
    mesh = ParallelDims.from_world(WORLD, tp=WORLD).build_mesh()
    torch.manual_seed(0)
    if family == "bert":
        reference: torch.nn.Module = BertModel(TransformerConfig(**(SHAPE | overrides)))
    else:
        config = TransformerConfig(**(SHAPE | {"decoder_seq_length": 8} | overrides))
        reference = T5Model(config)
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sp)
    batch = _batch()
    loss_ref, binary_ref = _loss(reference, family, batch)
    loss, binary = _loss(model, family, batch)
    loss_ref.backward()
    loss.backward()
    sync_tensor_parallel_grads(model)
    grads = dict(model.named_parameters())
    worst = 0.0
    for name, p_ref in reference.named_parameters():
        scale = float(p_ref.grad.abs().max()) or 1.0
        worst = max(worst, float((_full(grads[name].grad) - p_ref.grad).abs().max()) / scale)
    return {
        "loss": [float(loss), float(loss_ref)],
        "binary": [binary, binary_ref],
        "grad_rel": worst,
        "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "norm": [
            clip_grad_norm(model.parameters(), 1e9),
            float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)),
        ],
    }


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    report = {name: _scenario(*spec) for name, spec in SCENARIOS.items()}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_bert_t5")
    launch_workers(__file__, WORLD, [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow  # ~50 s; mg-train's test_bert_t5_parallel covers TP + SP end to end
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sharded_bert_and_t5_match_one_process(reports, scenario: str) -> None:
    for rank in range(WORLD):
        r = reports[rank][scenario]
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=RTOL), (rank, r["loss"])
        assert r["binary"][0] == pytest.approx(r["binary"][1], rel=RTOL, abs=1e-6)
        assert r["grad_rel"] < RTOL, (rank, r["grad_rel"])
        assert r["norm"][0] == pytest.approx(r["norm"][1], rel=RTOL)


@pytest.mark.slow
def test_what_is_sharded(reports) -> None:
    """Megatron's layout: vocab-parallel embedding and output (bias included), column/row-
    parallel attention (T5's cross-attention too) and MLP; heads and norms replicated."""
    bert = reports[0]["bert-untied"]["sharded"]
    assert "output_layer.bias" in bert and "output_layer.weight" in bert
    assert "encoder.layers.0.self_attention.linear_qkv.weight" in bert
    assert not [n for n in bert if n.startswith(("lm_head", "pooler", "binary_head"))]
    assert "output_layer.bias" in reports[0]["bert-pre_ln"]["sharded"]  # tied: the bias alone
    t5 = reports[0]["t5-sp"]["sharded"]
    for name in ("linear_q", "linear_kv", "linear_proj"):
        assert f"decoder.layers.1.cross_attention.{name}.weight" in t5
    assert "lm_head.output_layer.bias" in t5


if __name__ == "__main__":
    _worker(sys.argv[1])
