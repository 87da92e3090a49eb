"""What a quantized checkpoint records about itself (``state["mg"]["quantization"]``).

A reader needs the recipe (which module type replaces each linear), the int4
group size and the names of the quantized linears; the rest (calibration,
damping, smoothing alpha) is provenance for people.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

RECIPES = ("int8_wo", "int4_wo", "int4_awq", "int4_gptq", "int8_sq", "fp8")
INT4_RECIPES = ("int4_wo", "int4_awq", "int4_gptq")


@dataclass
class QuantizationConfig:
    recipe: str
    modules: list[str] = field(default_factory=list)
    """Dotted names of the linears that were quantized (the others stay in float)."""
    group_size: int | None = None
    """int4 recipes: input columns per scale."""
    symmetric: bool = True
    fp8_per_channel: bool = False
    """fp8: one weight scale per output channel instead of one per tensor."""
    details: dict[str, Any] = field(default_factory=dict)
    """How it was made (calibration samples, GPTQ damping, SmoothQuant alpha, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationConfig:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        config = cls(**known)
        if config.recipe not in RECIPES:
            raise ValueError(
                f"quantization recipe {config.recipe!r} is not known to this version "
                f"(known: {', '.join(RECIPES)}); upgrade mg-core"
            )
        return config
