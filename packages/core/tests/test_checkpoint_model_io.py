"""load_model rebuilds the model from the checkpoint alone; save_model writes the
trainer's state."""

import pytest
import torch

from mg.core.checkpoint import CheckpointError, load_checkpoint, save_checkpoint_shards
from mg.core.checkpoint.model_io import load_model, save_model
from mg.core.models import GPTModel, TransformerConfig
from mg.core.tokenizers.config import TokenizerConfig

CONFIG = TransformerConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=16,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    num_query_groups=2,
)


def test_round_trip_is_self_describing(tmp_path):
    torch.manual_seed(0)
    model = GPTModel(CONFIG).eval()
    (tmp_path / "ckpt" / "tok").mkdir(parents=True)
    tokenizer = TokenizerConfig("HuggingFaceTokenizer", tokenizer_model="tok")
    save_model(tmp_path / "ckpt", model, CONFIG, tokenizer, iteration=7, args={"lr": 1e-4})

    loaded, config, tok, info = load_model(tmp_path / "ckpt")
    assert config == CONFIG and info.iteration == 7 and info.args == {"lr": 1e-4}
    assert tok.tokenizer_model == str((tmp_path / "ckpt" / "tok").resolve())
    assert not loaded.training
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    state, _ = load_checkpoint(tmp_path / "ckpt")  # the trainer's layout
    assert set(state) >= {"model", "mg", "args", "iteration", "checkpoint_version"}
    assert state["mg"]["model_config"] == CONFIG.to_dict()


def test_release_from_state_dict(tmp_path):
    weights = GPTModel(CONFIG).state_dict()
    save_model(tmp_path, weights, CONFIG, None)
    _, _, tok, info = load_model(tmp_path)
    assert tok is None and info.iteration == "release"


def test_errors_name_the_problem(tmp_path):
    save_checkpoint_shards(tmp_path / "bare", 1, {(0, 0): {"model": {}}})
    with pytest.raises(CheckpointError, match="records no model config"):
        load_model(tmp_path / "bare")
    weights = GPTModel(CONFIG).state_dict()
    del weights["decoder.final_layernorm.weight"]
    save_model(tmp_path / "short", weights, CONFIG, None)
    with pytest.raises(CheckpointError, match="final_layernorm"):
        load_model(tmp_path / "short")


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipeline_split_torch_checkpoint_loads_whole(tmp_path, virtual):
    """mp_rank_00_PPP files (PP=2 with `model`, or model0/model1 per virtual stage, local
    layer numbers, the last stage's tied copy) load into the whole model, bit-exact."""
    from mg.core.checkpoint import mg_metadata
    from mg.core.checkpoint.pp_split import split_pipeline

    config = TransformerConfig.from_dict({**CONFIG.to_dict(), "num_layers": 4})
    reference = GPTModel(config).state_dict()
    stages = split_pipeline(reference, 4, 2, tied=True, virtual_size=virtual)
    assert "output_layer.weight" in stages[1][-1]  # the tied copy is written, as Megatron does
    meta = mg_metadata(config.to_dict(), None)
    shards = {}
    for pp, chunks in enumerate(stages):
        models = (
            {"model": chunks[0]} if virtual == 1 else {f"model{i}": c for i, c in enumerate(chunks)}
        )
        shards[(0, pp)] = {**models, "mg": meta, "iteration": 1}
    save_checkpoint_shards(tmp_path, 1, shards)
    model, _, _, _ = load_model(tmp_path)
    loaded = model.state_dict()
    assert list(loaded) == list(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name


def _megatron_tp_split(weights: dict, tp: int) -> list[dict]:
    """Megatron's per-rank shards, written out independently of mg's merge code:
    QKV/fc1/embeddings by rows (fc1's gate and up halves each), proj/fc2 by columns."""
    shards = [{} for _ in range(tp)]
    for name, tensor in weights.items():
        if name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
        elif name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            parts = list(tensor.chunk(tp, dim=0))
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = list(tensor.chunk(tp, dim=1))
        else:
            parts = [tensor] * tp
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part.clone()
    return shards


def test_tensor_parallel_torch_checkpoint_is_merged(tmp_path):
    """A TP=2 `torch` checkpoint (mp_rank_00, mp_rank_01) loads as the whole model."""
    from mg.core.checkpoint import mg_metadata

    torch.manual_seed(0)
    weights = GPTModel(CONFIG).state_dict()
    meta = mg_metadata(CONFIG.to_dict(), None, tp=2)
    shards = {
        (rank, 0): {"model": shard, "mg": meta}
        for rank, shard in enumerate(_megatron_tp_split(weights, 2))
    }
    save_checkpoint_shards(tmp_path / "tp2", 1, shards)
    model, *_ = load_model(tmp_path / "tp2")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
