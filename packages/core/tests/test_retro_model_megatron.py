"""RetroModel against megatron-core 0.15's RetroModel (local spec, CPU, fp32).

megatron-core 0.16 dropped Retro, and the project's lock holds 0.16.1, so the
reference runs in a subprocess with the pinned 0.15.3 wheel (`mg.core.fixtures.
unpacked_wheel`) first on its sys.path and 0.16.1's dependencies otherwise. Our
model's state dict is loaded into Megatron's with `strict=True` (the names and shapes
are Megatron's), both models run the same tokens and neighbours, and the logits are
compared; the torch_dist keys we write are those of its `sharded_state_dict` (layers
keyed by number, the local spec's fused norm names, inside the encoder too).
Megatron's CUDA assumptions on the forward path are patched to CPU the way
`mg.core.testing.megatron_reference` does for 0.16.1; 0.15's import-time CUDA
allocator build is told there is no toolchain, and its RetroConfig that there is no
Transformer Engine (its version check fails on None).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint.megatron_sharded_keys import key_layout, megatron_sharded_key
from mg.core.models.retro import RetroConfig, RetroModel

pytestmark = [pytest.mark.compat, pytest.mark.slow]

REFERENCE = r"""
import json, sys
import torch
import torch.utils.cpp_extension as cpp_extension

def no_toolchain(*args, **kwargs):
    raise RuntimeError("no CUDA toolchain")

cpp_extension.load_inline = no_toolchain  # 0.15 builds a CUDA allocator at import

import torch.nn.functional as F
from mg.core.testing.megatron_reference import megatron_cpu_patches
import megatron.core
assert megatron.core.__version__.startswith("0.15"), megatron.core.__version__
from megatron.core import parallel_state
from megatron.core.models.retro import RetroConfig, RetroModel, get_retro_decoder_block_spec
import megatron.core.models.retro.config as retro_config

retro_config.is_te_min_version = lambda version: False  # no Transformer Engine here

work = sys.argv[1]
shape = json.load(open(f"{work}/config.json"))
patches = megatron_cpu_patches()
store = f"file://{work}/store"
torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
config = RetroConfig(
    num_layers=shape["num_layers"],
    hidden_size=shape["hidden_size"],
    num_attention_heads=shape["num_attention_heads"],
    ffn_hidden_size=shape["ffn_hidden_size"],
    normalization=shape["normalization"],
    gated_linear_unit=shape["gated"],
    activation_func=F.silu if shape["gated"] else F.gelu,
    add_bias_linear=shape["add_bias_linear"],
    attention_dropout=0.0,
    hidden_dropout=0.0,
    use_cpu_initialization=True,
    transformer_impl="local",
    retro_chunk_length=shape["retro_chunk_length"],
    retro_encoder_num_layers=shape["retro_encoder_num_layers"],
    retro_encoder_hidden_dropout=0.0,
    retro_encoder_attention_dropout=0.0,
    retro_num_neighbors=shape["retro_num_neighbors"],
    retro_num_retrieved_chunks=shape["retro_num_retrieved_chunks"],
    retro_split_preprocessing="98,2,0",
)
model = RetroModel(
    config,
    get_retro_decoder_block_spec(config, use_transformer_engine=False),
    vocab_size=shape["vocab_size"],
    max_sequence_length=shape["max_position_embeddings"],
    position_embedding_type=shape["position_embedding_type"],
    share_embeddings_and_output_weights=not shape["untie"],
).eval()
ours = torch.load(f"{work}/weights.pt")
extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
model.load_state_dict({**ours, **extra}, strict=True)
inputs = torch.load(f"{work}/inputs.pt")
with torch.no_grad():
    logits = model(
        inputs["tokens"], inputs["position_ids"], None,
        context_input_ids=inputs["neighbours"],
        context_position_ids=inputs["neighbour_position_ids"],
        context_mask=None,
    )
def global_shape(v):  # a gated fc1 is a factory (its halves stored apart) of the whole tensor
    return tuple(v.global_shape) if hasattr(v, "global_shape") else tuple(v.data.shape)

sharded = {
    v.key: (global_shape(v), getattr(v, "prepend_axis_num", 0))
    for k, v in model.sharded_state_dict().items()
    if not k.endswith("_extra_state")
}
names = sorted(k for k in model.state_dict() if k not in extra)
torch.save({"logits": logits, "names": names, "sharded": sharded}, f"{work}/reference.pt")
"""


def run_reference(work: Path, config: RetroConfig, untie: bool) -> dict:
    """Megatron-Core 0.15's logits for the weights and inputs saved in `work`."""
    from mg.core.fixtures import unpacked_wheel

    shape = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "normalization": config.normalization,
        "gated": config.gated_linear_unit,
        "add_bias_linear": config.add_bias_linear,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "position_embedding_type": config.position_embedding_type,
        "untie": untie,
        "retro_chunk_length": config.retro_chunk_length,
        "retro_encoder_num_layers": config.retro_encoder_num_layers,
        "retro_num_neighbors": config.retro_num_neighbors,
        "retro_num_retrieved_chunks": config.retro_num_retrieved_chunks,
    }
    import json

    (work / "config.json").write_text(json.dumps(shape))
    site = unpacked_wheel("megatron-core-0.15")
    # megatron-core asserts on the attention-backend variables an earlier in-process
    # megatron model may have left in this process's environment: start without them
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), *sys.path]), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(work)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # megatron-core imports slowly on a busy machine
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(work / "reference.pt")


CASES = {
    # GPT-2 style (LayerNorm, biases, learned positions, tied output), 2 neighbours of
    # 2 chunks, 3 chunks per sample and 2 samples: Megatron's row mixing is exercised
    "gpt2-like": dict(
        config=dict(normalization="LayerNorm", activation="gelu"),
        seq_length=24,
        untie=False,
    ),
    # Llama style (RMSNorm, SwiGLU, RoPE in the decoder, no biases, untied output), a
    # sequence that is not a multiple of the chunk length (Megatron pads the first chunk)
    "llama-like": dict(
        config=dict(
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            position_embedding_type="rope",
            untie_embeddings_and_output_weights=True,
        ),
        seq_length=22,
        untie=True,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_retro_logits_equal_megatron_core_015(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    config = RetroConfig(
        num_layers=7,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        vocab_size=96,
        seq_length=24,
        max_position_embeddings=32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        retro_encoder_hidden_dropout=0.0,
        retro_encoder_attention_dropout=0.0,
        retro_chunk_length=8,
        retro_encoder_num_layers=2,
        retro_num_neighbors=2,
        retro_num_retrieved_chunks=2,
        **case["config"],
    )
    torch.manual_seed(0)
    model = RetroModel(config).eval()
    with torch.no_grad():  # random norms and biases too, so that every name is checked
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    torch.save(model.state_dict(), tmp_path / "weights.pt")

    g = torch.Generator().manual_seed(1)
    b, s, m = 2, case["seq_length"], config.retro_chunk_length
    chunks = -(-s // m)
    r = config.retro_retrieved_length
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=g)
    neighbours = torch.randint(0, config.vocab_size, (b * chunks * config.retro_num_neighbors, r))
    inputs = {
        "tokens": tokens,
        "position_ids": torch.arange(s).expand(b, s).contiguous(),
        "neighbours": neighbours,
        "neighbour_position_ids": torch.arange(r).expand(neighbours.shape[0], r).contiguous(),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    reference = run_reference(tmp_path, config, case["untie"])

    assert reference["names"] == sorted(model.state_dict())
    # torch_dist: our keys (mg.core.checkpoint.megatron_sharded_keys) are its sharded_state_dict's
    layout = key_layout(config)
    ours = {}
    for param, tensor in model.state_dict().items():
        key = megatron_sharded_key(param, layout)
        ours[key.key] = (tuple(tensor.shape), key.prepend_axis_num)
    assert ours == reference["sharded"]
    with torch.no_grad():
        logits = model(
            tokens,
            inputs["position_ids"],
            context_input_ids=neighbours,
            context_position_ids=inputs["neighbour_position_ids"],
        )
    expected = reference["logits"]
    diff = (logits - expected).abs().max().item()
    print(f"{name}: max |logits - megatron-core 0.15.3| = {diff:.3g}")
    assert logits.shape == expected.shape
    assert diff <= 1e-5
