"""The H200 profile behind ``simtree/data/costs/h200_*.json`` (``profile.csv`` with its
``profile.meta.json`` and ``profile.compose.json`` sidecars); refit by
``scripts/ship_defaults.sh``."""
