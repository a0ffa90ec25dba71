"""Shipped data files (model shapes, ...); package data only."""
