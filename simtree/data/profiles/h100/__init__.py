"""The H100 rank profiles of the real-architecture layers (DeepSeek-V4-Flash ep=8 at FP8,
Qwen3.6-27B tp=1), from one full-runtime session each (``scripts/full_gpu.sh``, unpacked by
``scripts/full_report.sh``: reports/h100/live), behind the H100 defaults
``simtree/data/costs/h100_*.json`` (refit by ``scripts/ship_defaults.sh``); the same bundles,
frozen in reports/validation (``frozen_h100_*.json``), are tested out of sample there."""
