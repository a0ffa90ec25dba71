"""simtree's SGLang plugin: SGLang runs simtree's controller where its adaptive config asks.

Installed with simtree as the entry point ``simtree`` of SGLang's general plugin group
``sglang.srt.plugins`` (``pyproject.toml``), which SGLang 0.5.23 loads in every process
(``sglang/srt/plugins/__init__.py``: ``load_plugins``; ``SGLANG_PLUGINS``, where set, must name
``simtree``).  :func:`register` puts :class:`AdaptiveParamsDispatch` in the place of
``sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams`` (SGLang's
``HookRegistry``, a class replacement): given an adaptive config with a ``"simtree"`` entry it
builds :class:`simtree.engines.sglang_controller.SimtreeAdaptiveParams`; any other config, or
none, SGLang's own class, unchanged.  So installing simtree beside SGLang changes nothing until
a launch names a config ``simtree export sglang`` wrote (``adaptive_controller.json``).

SGLang's original class is kept in a dict, not bound to a module name: SGLang's patch rebinds
every module attribute that holds the original (its ``_propagate_patch``).
"""
from __future__ import annotations

__all__ = ["TARGET", "AdaptiveParamsDispatch", "register"]

TARGET = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
_ORIGINAL: dict = {}


class AdaptiveParamsDispatch:
    """``AdaptiveSpeculativeParams(initial_steps, cfg_path)`` as SGLang calls it: simtree's
    controller for a config with a ``"simtree"`` entry, SGLang's own class otherwise."""

    def __new__(cls, initial_steps: int, cfg_path: str | None = None):
        from simtree.engines.sglang_controller import SimtreeAdaptiveParams, has_controller
        if cfg_path is not None and has_controller(cfg_path):
            return SimtreeAdaptiveParams(initial_steps, cfg_path)
        return _ORIGINAL["params"](initial_steps=initial_steps, cfg_path=cfg_path)


def register() -> None:
    """SGLang's plugin entry: replace its adaptive-steps policy class by the dispatch."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import adaptive_spec_params
    current = adaptive_spec_params.AdaptiveSpeculativeParams
    if getattr(current, "__name__", "") != AdaptiveParamsDispatch.__name__:   # not a dispatch (of a reloaded module)
        _ORIGINAL.setdefault("params", current)
    HookRegistry.register(TARGET, AdaptiveParamsDispatch, HookType.REPLACE)
