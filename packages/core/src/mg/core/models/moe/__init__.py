"""Mixture of Experts: router, token dispatch, experts, and the layer that joins them."""

from mg.core.models.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mg.core.models.moe.experts import GroupedMLP, SequentialMLP, SharedExpertMLP
from mg.core.models.moe.layer import MoELayer
from mg.core.models.moe.router import AuxLossBackward, TopKRouter

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "AuxLossBackward",
    "GroupedMLP",
    "MoELayer",
    "SequentialMLP",
    "SharedExpertMLP",
    "TopKRouter",
]
