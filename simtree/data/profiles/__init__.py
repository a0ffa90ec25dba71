"""The measured profile (table + .meta.json sidecar) the shipped cost bundles are fitted from."""
