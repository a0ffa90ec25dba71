"""Serving engines in and out: acceptance read from vLLM's and SGLang's metrics
(:mod:`.metrics`), simtree's policies written as what each engine takes (:mod:`.export`), and
simtree's online controller as SGLang's adaptive-steps policy (:mod:`.sglang_controller`, put in
place by SGLang's plugin loader: :mod:`.sglang_plugin`)."""
