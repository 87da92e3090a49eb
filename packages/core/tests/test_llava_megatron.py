"""LLaVAModel against megatron-core 0.16.1's LLaVAModel (local specs, CPU, fp32).

megatron-core builds its LLaVAModel on CPU with the local layer specs once its CLIP
tower's pre-LayerNorm is given a class that takes its `config` argument (without
Transformer Engine its default is `torch.nn.LayerNorm`, which does not). Our model's
state dict loads into Megatron's (names and shapes equal; Megatron's `_extra_state`
entries are its linears' empty TE state), both run the same image and tokens, and the
logits agree to 1e-5. Our `torch_dist` keys are Megatron's `sharded_state_dict` keys,
the layers' norms under the Transformer Engine spec's fused names (megatron-core's
local LLaVA specs have no keys map and keep `input_layernorm.*`; the TE spec, which
`pretrain_vlm.py` builds by default, fuses them as every mg family writes them).
megatron-core's own `dist_checkpointing.load` reads our `torch_dist` save into its
LLaVAModel given the TE spec's keys (as its GPT local spec maps them), with the same
logits after. The local ViT spec's attention is causal; the TE spec's, CLIP's and ours are not: the
reference is built with its mask type set to `no_mask`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from mg.core.checkpoint.megatron_sharded_keys import (  # noqa: E402
    FUSED_NORMS,
    key_layout,
    megatron_sharded_key,
)
from mg.core.models import TransformerConfig  # noqa: E402
from mg.core.models.vision import LLaVAConfig, LLaVAModel, VisionConfig  # noqa: E402
from mg.core.models.vision.vit import quick_gelu  # noqa: E402
from mg.core.testing.megatron_reference import megatron_on_cpu  # noqa: E402

pytestmark = [pytest.mark.compat, pytest.mark.slow]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        yield


def _ours() -> LLaVAModel:
    language = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=128,
        seq_length=16,
        max_position_embeddings=16,
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    vision = VisionConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, img_h=28, img_w=28
    )
    torch.manual_seed(0)
    return LLaVAModel(LLaVAConfig(language=language, vision=vision)).eval()


# Megatron-LM's Transformer Engine spec keys (the norms under their fused linears), given to
# the local specs as megatron-core's GPT local spec gives them (`sharded_state_dict_keys_map`)
_TE_KEYS = {ours: theirs for ours, theirs in FUSED_NORMS[:2]}


def _megatron_llava(ours: LLaVAModel, te_keys: bool = False):
    """megatron-core's LLaVAModel of the same shape (local specs); `te_keys`: its sharded
    keys those of Megatron-LM's Transformer Engine spec."""
    import megatron.core.models.vision.clip_vit_model as clip_vit_model  # lazy: test-only
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel as MegatronLLaVA
    from megatron.core.models.multimodal.llava_spec import decoder_model_with_local_default_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig as MConfig

    class PreNorm(torch.nn.LayerNorm):  # the CLIP tower's ln_pre, as build_module calls it
        def __init__(self, config, hidden_size: int, eps: float) -> None:
            super().__init__(hidden_size, eps=eps)

    from megatron.core.transformer.enums import AttnMaskType

    vit_spec = get_vit_layer_with_local_spec()  # its attention causal: CLIP's is not (TE spec's)
    vit_spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    lm_spec = decoder_model_with_local_default_spec()
    if te_keys:
        vit_spec.submodules.sharded_state_dict_keys_map = dict(_TE_KEYS)
        lm_spec.submodules.sharded_state_dict_keys_map = dict(_TE_KEYS)
    lm, v = ours.config.language, ours.config.vision
    common = dict(use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    language = MConfig(
        num_layers=lm.num_layers,
        hidden_size=lm.hidden_size,
        num_attention_heads=lm.num_attention_heads,
        ffn_hidden_size=lm.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        **common,
    )
    vision = MConfig(
        num_layers=v.num_layers,
        hidden_size=v.hidden_size,
        num_attention_heads=v.num_attention_heads,
        ffn_hidden_size=v.ffn_hidden_size,
        activation_func=quick_gelu,
        layernorm_epsilon=v.layernorm_epsilon,
        **common,
    )
    vision.vision_model_type = "clip"
    projection = MConfig(
        num_layers=1,
        hidden_size=lm.hidden_size,
        num_attention_heads=1,
        ffn_hidden_size=ours.config.projector_ffn_hidden_size,
        activation_func=F.gelu,
        **common,
    )
    defaults = clip_vit_model.CLIPViTModel.__init__.__defaults__
    patched = tuple(PreNorm if d is torch.nn.LayerNorm else d for d in defaults)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clip_vit_model.CLIPViTModel.__init__, "__defaults__", patched)
        return MegatronLLaVA(
            language,
            lm_spec,
            lm.vocab_size,
            lm.seq_length,
            vision,
            vit_spec,
            False,
            projection,
            get_mlp_module_spec(use_te=False).submodules,
            img_h=v.img_h,
            img_w=v.img_w,
            patch_dim=v.patch_dim,
            language_position_embedding_type="rope",
        ).eval()


def test_logits_equal_megatron_core_llava(megatron) -> None:
    ours = _ours()
    theirs = _megatron_llava(ours)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert unexpected == []
    assert all(k.endswith("._extra_state") for k in missing), missing
    text = ours.config.language.seq_length - ours.config.image_tokens + 1
    ids = torch.randint(0, 128, (2, text))
    ids[:, 2] = ours.config.image_token_index
    images = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        expected = ours(images, ids)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        logits, _ = theirs(images, ids, positions, None)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _unfused(key: str) -> str:
    for ours, theirs in FUSED_NORMS:
        key = key.replace(theirs, ours)
    return key


def test_torch_dist_keys_are_megatron_cores(megatron) -> None:
    ours = _ours()
    theirs = _megatron_llava(ours).sharded_state_dict()
    layout = key_layout(ours.config)
    for name, tensor in ours.state_dict().items():
        sharded = megatron_sharded_key(name, layout)
        reference = theirs[name]
        assert _unfused(sharded.key) == reference.key, name
        if hasattr(reference, "global_shape"):  # not a SwiGLU fc1's factory (two halves)
            assert sharded.prepend_axis_num == reference.prepend_axis_num, name
            shape = (*(n for _, n in sharded.prepended), *tensor.shape)
            assert shape == reference.global_shape, name


def test_megatron_core_loads_our_torch_dist_checkpoint(megatron, tmp_path, monkeypatch) -> None:
    """Our LLaVA saved in Megatron-Core's layout, read by megatron-core's own
    `dist_checkpointing.load` into its LLaVAModel (the TE spec's keys): the same logits."""
    from mg.core.checkpoint.dist_format import save_dist_checkpoint
    from mg.core.checkpoint.megatron_dist import megatron_model_state
    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
    )

    ours = _ours()
    state = megatron_model_state(ours.state_dict(), key_layout(ours.config), extra_state=True)
    save_dist_checkpoint(tmp_path / "ckpt", 1, {**state.tensors, **state.objects}, {})
    theirs = _megatron_llava(ours, te_keys=True)
    dist_checkpointing_cpu_patches(monkeypatch)
    load_into_megatron(tmp_path / "ckpt" / "iter_0000001", theirs)
    text = ours.config.language.seq_length - ours.config.image_tokens + 1
    ids = torch.randint(0, 128, (2, text))
    ids[:, 0] = ours.config.image_token_index
    images = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        expected = ours(images, ids)
        logits, _ = theirs(images, ids, torch.arange(text).expand_as(ids), None)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
