"""Online control of speculation: :class:`Controller` picks each step's tier (docs/controller.md)."""
from simtree.control.controller import DEFAULT_TIERS, Controller, Tier, tier_shape

__all__ = ["Controller", "Tier", "DEFAULT_TIERS", "tier_shape"]
