"""MoE routing for serving: every token reaches its top-k experts, whatever shares its step.

A capacity factor (`moe_expert_capacity_factor`) lets each expert take at most
ceil(T·k/E · factor) of the T tokens of one forward. In a server's packed step
T is every running sequence's tokens together, so which tokens an expert drops
would depend on which other requests happen to share the step: a sequence's
output would change with the traffic. The engine therefore routes dropless
(the capacity is a training-time limit; transformers' MoE models have none),
and says so by name when a checkpoint records one.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from mg.core.models.moe import TopKRouter

log = logging.getLogger("mg.generate_server")


def route_dropless(model: nn.Module) -> float | None:
    """Give every router of `model` its config without the capacity limit; the capacity
    factor the checkpoint recorded (None: it was dropless already)."""
    factor = None
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        if router.config.moe_expert_capacity_factor is None:
            continue
        factor = router.config.moe_expert_capacity_factor
        router.config = dataclasses.replace(
            router.config,
            moe_expert_capacity_factor=None,
            moe_pad_expert_input_to_capacity=False,
        )
    if factor is not None:
        log.warning(
            "the checkpoint's moe_expert_capacity_factor %s is not applied when serving: "
            "routing is dropless, so a request's tokens do not depend on the others in a step",
            factor,
        )
    return factor
