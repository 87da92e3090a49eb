"""Which layer is which in a hybrid model: Megatron's layer pattern and its allocation.

`--hybrid-override-pattern` gives one letter per layer (`M` Mamba, `*` attention,
`-` MLP, `E` MoE). Without it, `--hybrid-attention-ratio` / `--hybrid-mlp-ratio`
place that share of attention and MLP layers evenly among the Mamba layers, by
megatron-core 0.16.1's `allocate_layers` rule (`ssm/mamba_hybrid_layer_allocation.py`),
reproduced here step for step so that the same flags give the same model. With
both, the pattern must have the counts the ratios ask for (Megatron's check).
"""

from __future__ import annotations

MAMBA = "M"
ATTENTION = "*"
MLP = "-"
MOE = "E"
LAYER_SYMBOLS = (MAMBA, ATTENTION, MLP, MOE)


def _allocate_auto(total: int, attention_ratio: float, mlp_ratio: float) -> list[str]:
    # Attention evenly spaced, sections of Mamba before, between and after.
    attention_count = round(total * attention_ratio)
    mamba_count = total - attention_count
    section = mamba_count / (attention_count + 1)
    layers = [MAMBA] * total
    x = section
    for i in range(total):
        if x < 0.5:
            layers[i] = ATTENTION
            x += section
        else:
            x -= 1
    # Then MLP layers replace Mamba layers, evenly but right-justified.
    mlp_count = round(total * mlp_ratio)
    if mlp_count > 0:
        mamba_count -= mlp_count
        ratio = mamba_count / mlp_count
        x = ratio
        for i in range(total):
            if layers[i] == MAMBA:
                if x < 0.5:
                    layers[i] = MLP
                    x += ratio
                else:
                    x -= 1
    return layers


def allocate_layers(
    total: int,
    attention_ratio: float = 0.0,
    mlp_ratio: float = 0.0,
    override_pattern: str | None = None,
) -> list[str]:
    """The layer type of each of `total` layers; ValueError names the flag at fault."""
    if total <= 0:
        raise ValueError(f"--num-layers must be positive, got {total}")
    for flag, ratio in (
        ("--hybrid-attention-ratio", attention_ratio),
        ("--hybrid-mlp-ratio", mlp_ratio),
    ):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{flag} must be in [0, 1], got {ratio}")
    if attention_ratio + mlp_ratio > 1.0:
        raise ValueError(
            "--hybrid-attention-ratio + --hybrid-mlp-ratio must be at most 1, got "
            f"{attention_ratio} + {mlp_ratio}"
        )
    layers = _allocate_auto(total, attention_ratio, mlp_ratio)
    if override_pattern is None:
        return layers

    override = list(override_pattern)
    if len(override) != total:
        raise ValueError(
            f"--hybrid-override-pattern {override_pattern!r} has {len(override)} layers, "
            f"--num-layers is {total}"
        )
    for letter in override:
        if letter == MOE:
            raise ValueError(
                "--hybrid-override-pattern: MoE layers ('E') are not supported yet; "
                "use M (Mamba), * (attention) and - (MLP)"
            )
        if letter not in LAYER_SYMBOLS:
            raise ValueError(
                f"--hybrid-override-pattern: {letter!r} is not a layer type; "
                "use M (Mamba), * (attention) and - (MLP)"
            )
    if (attention_ratio > 0.0 or mlp_ratio > 0.0) and any(
        override.count(s) != layers.count(s) for s in LAYER_SYMBOLS
    ):
        raise ValueError(
            f"--hybrid-override-pattern {override_pattern!r} does not have the layer counts "
            f"that --hybrid-attention-ratio {attention_ratio} and --hybrid-mlp-ratio "
            f"{mlp_ratio} ask for ({''.join(layers)!r}); give the pattern alone"
        )
    return override
