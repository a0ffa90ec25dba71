"""Shipped draft checkpoint (config.json + model.safetensors); a package so its files install as package data."""
