"""The H100 rank profiles of the real-architecture layers (DeepSeek-V4-Flash ep=8 at FP8,
Qwen3.6-27B tp=1), from one full-runtime session each (``scripts/full_gpu.sh``, unpacked by
``scripts/full_report.sh``: reports/h100/live); the bundles fitted on them are frozen in
reports/validation (``frozen_h100_*.json``) and tested out of sample there."""
