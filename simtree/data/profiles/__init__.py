"""Shipped profile tables (package data): the measurements the shipped cost bundles in
``simtree/data/costs/`` are fitted from, one folder per machine."""
