"""mg-train saves a BERT's and a T5's `torch_dist` checkpoint in Megatron-Core's layout, as
it saves a GPT's: each block's layers stacked on its own layer axis
(`encoder.layers.self_attention.linear_qkv.weight` [L, 3h, h]), the pre-attention and
pre-MLP norms under the names they have fused into the next linear, a T5 decoder's
cross-attention beside them. The stored tensor keys and global shapes are megatron-core
0.16.1's `sharded_state_dict()`'s for the model `pretrain_bert.py` / `pretrain_t5.py`
build (local spec, tied output layer); its `dist_checkpointing.load` fills megatron-core's
BertModel from mg-train's checkpoint with the weights we saved, bit for bit; and mg reads
its own checkpoint back whole (mg-eval's reader).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint.dist_format import load_common, load_full_state
from mg.core.checkpoint.reader_guard import read_dcp_metadata
from mg.core.models import TransformerConfig
from mg.core.models.t5 import T5Model as T5Model_ours
from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from sentence_data import build_sentence_corpus, fill, template_argv  # noqa: E402

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_sentence_corpus(tmp_path_factory.mktemp("sentences"))


def _train_and_save(family: str, corpus: str, tmp_path: Path) -> Path:
    argv = fill(template_argv(family), corpus, str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    iters = ["--train-iters", "4", "--eval-iters", "0", "--ckpt-format", "torch_dist"]
    Trainer(parse_args([*argv, *iters, "--save", str(ckpt)])).train()
    return ckpt


def _stored(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model tensors' keys and global shapes of a torch_dist folder."""
    return {
        key: tuple(meta.size)
        for key, meta in read_dcp_metadata(folder).state_dict_metadata.items()
        if hasattr(meta, "size") and not key.startswith(("optimizer.", "rng")) and "/" not in key
    }


def _read_back(ckpt: Path) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """The checkpoint's weights under our names and its model config, as mg's tools read them."""
    (folder,) = ckpt.glob("iter_*")
    config = TransformerConfig.from_dict(dict(load_common(folder)["mg"]["model_config"]))
    return load_full_state(folder), config


def _megatron_config(config, **more):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        kv_channels=config.kv_channels,
        layernorm_epsilon=config.layernorm_epsilon,
        add_bias_linear=config.add_bias_linear,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
        **more,
    )


def test_bert_saves_megatron_layout_megatron_core_loads(corpus, tmp_path, monkeypatch) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
        megatron_sharded_keys,
    )
    from mg.core.testing.megatron_reference import megatron_on_cpu

    ckpt = _train_and_save("bert", corpus, tmp_path)
    (folder,) = ckpt.glob("iter_*")
    stored = _stored(folder)
    assert stored["encoder.layers.self_attention.linear_qkv.weight"] == (2, 96, 32)
    weights, config = _read_back(ckpt)  # mg-eval's reader: our names from Megatron's keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        with megatron_on_cpu(tmp_path), monkeypatch.context() as patches:
            dist_checkpointing_cpu_patches(patches)
            theirs = BertModel(
                config=_megatron_config(config),
                num_tokentypes=2,
                transformer_layer_spec=bert_layer_local_spec,
                vocab_size=config.vocab_size,
                max_sequence_length=config.max_position_embeddings,
                share_embeddings_and_output_weights=True,  # pretrain_bert.py's default
                add_binary_head=True,
            )
            tensors, objects = megatron_sharded_keys(theirs)
            load_into_megatron(folder, theirs)
    assert stored == tensors
    assert objects - {"output_layer._extra_state/shard_0_1"} <= set(
        read_dcp_metadata(folder).state_dict_metadata
    )
    loaded = {k: v for k, v in theirs.state_dict().items() if not k.endswith("_extra_state")}
    assert loaded.keys() == weights.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, weights[name]), name


def test_t5_saves_megatron_layout(corpus, tmp_path, monkeypatch) -> None:
    """megatron-core's T5 block specs give their final norms to Transformer Engine (which
    a CPU lacks): here a local LayerNorm in its place, under the same keys."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
        megatron_sharded_keys,
    )
    from mg.core.testing.megatron_reference import megatron_on_cpu

    ckpt = _train_and_save("t5", corpus, tmp_path)
    (folder,) = ckpt.glob("iter_*")
    stored = _stored(folder)
    assert stored["decoder.layers.cross_attention.linear_kv.weight"] == (2, 64, 32)
    back, config = _read_back(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with megatron_on_cpu(tmp_path), monkeypatch.context() as patches:
            patches.setattr(t5_spec, "TENorm", WrappedTorchNorm)
            megatron_config = _megatron_config(config)
            theirs = T5Model(
                config=megatron_config,
                encoder_config=megatron_config,
                transformer_encoder_layer_spec=t5_spec.get_t5_encoder_with_local_block_spec(2),
                transformer_decoder_layer_spec=t5_spec.get_t5_decoder_with_local_block_spec(2),
                vocab_size=config.vocab_size,
                max_sequence_length=config.max_position_embeddings,
                share_embeddings_and_output_weights=True,  # pretrain_t5.py's default
            )
            tensors, _ = megatron_sharded_keys(theirs)
            dist_checkpointing_cpu_patches(patches)
            load_into_megatron(folder, theirs)
    assert stored == tensors
    assert back.keys() == T5Model_ours(config).state_dict().keys()
    loaded = {k: v for k, v in theirs.state_dict().items() if not k.endswith("_extra_state")}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, back[_our_t5_name(name)]), name


def _our_t5_name(name: str) -> str:
    """megatron-core's T5Model state-dict name as ours (its two aliases)."""
    for theirs, ours in (
        ("output_layer.", "lm_head.output_layer."),
        ("position_embeddings.", "embedding.position_embeddings."),
    ):
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name
