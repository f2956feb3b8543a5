"""Mixture-of-experts: routing rules, stacked experts (batched + loop reference), the MoE block."""

from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.layer import SparseMoE
from pdserve.layers.moe.router import RoutingConfig, TopKRouter

__all__ = ["Experts", "RoutingConfig", "SparseMoE", "TopKRouter"]
