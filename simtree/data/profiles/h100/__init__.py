"""The H100 rank profiles of the real-architecture layers (DeepSeek-V4-Flash ep=8 at FP8,
Qwen3.6-27B tp=1), from one full-runtime session each (``scripts/full_gpu.sh``, unpacked by
``scripts/full_report.sh``: reports/h100/live), behind the H100 defaults
``simtree/data/costs/h100_*.json`` (refit by ``scripts/ship_defaults.sh``).  The V4-Flash one was
timed again on 2026-12-08 on the runtime's path since (the fused forms, the attention's linears in
FP8; its ``.meta.json`` records it); the bundles frozen in reports/validation (``frozen_h100_*.json``),
tested out of sample there, are the earlier ones."""
