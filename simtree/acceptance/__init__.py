"""Acceptance: how many draft tokens the target accepts per tree node, fitted from traces or
presets, and the expected accepted length Phi(T) of a tree."""
