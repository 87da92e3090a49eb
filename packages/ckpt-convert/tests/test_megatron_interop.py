"""Against megatron-core 0.16.1: a Megatron-LM-layout checkpoint (Namespace args, raw
torch.save, `_extra_state` entries) imports with equal logits; export loads back strictly.

megatron-core is built on CPU with the same patches as core's
test_models_megatron_compat.py (CUDA-only buffers, mask and RNG tracker).
"""

import argparse
import contextlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from mg.ckpt_convert.megatron_lm import (  # noqa: E402
    export_megatron,
    import_megatron,
    megatron_args_from_config,
)
from mg.core.checkpoint import load_checkpoint  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402
from mg.core.models import RopeScaling, TransformerConfig  # noqa: E402

pytestmark = pytest.mark.compat


class _NoRngTracker:
    def fork(self, name=None):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.utils as mcore_utils
    from megatron.core import parallel_state

    patches = pytest.MonkeyPatch()
    patches.setattr(torch.cuda, "current_device", lambda: "cpu")
    patches.setattr(
        mcore_utils.GlobalMemoryBuffer,
        "get_tensor",
        lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype),
    )
    patches.setattr(
        fused_softmax,
        "get_default_causal_mask",
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1),
    )
    patches.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoRngTracker())
    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        patches.undo()


def _megatron_model(ours: TransformerConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import (
        TransformerConfig as MegatronTransformerConfig,
    )

    gated = ours.gated_linear_unit
    config = MegatronTransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        num_query_groups=ours.num_query_groups,
        ffn_hidden_size=ours.ffn_hidden_size,
        kv_channels=ours.kv_channels,
        normalization=ours.normalization,
        layernorm_epsilon=ours.layernorm_epsilon,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        add_bias_linear=ours.add_bias_linear,
        add_qkv_bias=ours.add_qkv_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=ours.init_method_std,
        use_cpu_initialization=True,
        transformer_impl="local",
    )
    return MegatronGPTModel(
        config,
        get_gpt_layer_local_spec(normalization=ours.normalization),
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        position_embedding_type=ours.position_embedding_type,
        share_embeddings_and_output_weights=not ours.untie_embeddings_and_output_weights,
        rotary_percent=ours.rotary_percent,
        rotary_base=int(ours.rotary_base),
        rope_scaling=ours.rope_scaling is not None,
        rope_scaling_factor=ours.rope_scaling.factor if ours.rope_scaling else 8.0,
    ).eval()


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
    reference = _megatron_model(config)
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
    again = _megatron_model(config)
    result = again.load_state_dict(state["model"], strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    with torch.no_grad():
        assert torch.equal(again(ids, torch.arange(16).expand(2, 16), None), expected)
