"""simtree.runtime.full: the full-scale runtime (Qwen3.6-27B, a DeepSeek-V4-Flash EP rank)."""
