"""Serving engines in and out: acceptance read from vLLM's and SGLang's metrics
(:mod:`.metrics`), simtree's policies written as what each engine takes (:mod:`.export`)."""
