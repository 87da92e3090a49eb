"""Against megatron-core 0.16.1: a Megatron-LM-layout checkpoint (Namespace args, raw
torch.save, `_extra_state` entries) imports with equal logits; export loads back strictly.

megatron-core is built on CPU with the same patches as core's
test_models_megatron_compat.py (CUDA-only buffers, mask and RNG tracker).
"""

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from mg.ckpt_convert.megatron_lm import (  # noqa: E402
    export_megatron,
    import_megatron,
    megatron_args_from_config,
)
from mg.core.checkpoint import load_checkpoint  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402
from mg.core.models import RopeScaling, TransformerConfig  # noqa: E402
from mg.core.testing.megatron_reference import (  # noqa: E402
    megatron_gpt_model,
    megatron_on_cpu,
)

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron.core, initialised for TP = PP = 1 on CPU."""
    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        yield


CONFIGS = {
    "gpt2-like": TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=16,
        activation="gelu",
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
    "llama-like": TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=128,
        seq_length=16,
        position_embedding_type="rope",
        rotary_base=500000.0,
        rope_scaling=RopeScaling(),
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
}


def _write_megatron_checkpoint(folder, model, args, iteration=10):
    """Exactly Megatron-LM's layout and keys (REFERENCE §4), written with torch.save."""
    rank_dir = folder / f"iter_{iteration:07d}" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.state_dict(),
        "rng_state": [],
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, rank_dir / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_round_trip(megatron, tmp_path, name):
    config = CONFIGS[name]
    torch.manual_seed(0)
    reference = megatron_gpt_model(config)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    args = megatron_args_from_config(config, None)
    args.tokenizer_type = "GPT2BPETokenizer"  # plus unrelated flags, as Megatron saves them
    args.lr, args.micro_batch_size = 3e-4, 4
    _write_megatron_checkpoint(tmp_path / "megatron", reference, args)

    import_megatron(tmp_path / "megatron", tmp_path / "ours")
    ours, imported_config, tokenizer, info = load_model(tmp_path / "ours")
    assert info.iteration == 10 and tokenizer.tokenizer_type == "GPT2BPETokenizer"
    assert imported_config.num_query_groups == config.num_query_groups
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids, torch.arange(16).expand(2, 16), None)
        diff = (ours(ids) - expected).abs().max().item()
    print(f"{name}: import-megatron max |Δlogits| = {diff:.2e}")
    assert diff <= 1e-4

    export_megatron(tmp_path / "ours", tmp_path / "back")
    state, iteration = load_checkpoint(tmp_path / "back", allow_pickle=True)
    assert iteration == 10 and isinstance(state["args"], argparse.Namespace)
    again = megatron_gpt_model(config)
    result = again.load_state_dict(state["model"], strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    with torch.no_grad():
        assert torch.equal(again(ids, torch.arange(16).expand(2, 16), None), expected)
