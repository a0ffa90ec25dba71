"""Serving simulation: arrival traces (:mod:`.traces`) through continuous batching
(:mod:`.sim`) under per-step policies (:mod:`.policies`), and the benchmark (:mod:`.bench`)."""
