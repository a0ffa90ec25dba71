"""Online control of speculation: :class:`Controller` picks each step's tier (docs/controller.md)."""
from simtree.control.controller import Controller
from simtree.control.tiers import DEFAULT_TIERS, Tier, tier_shape

__all__ = ["Controller", "Tier", "DEFAULT_TIERS", "tier_shape"]
