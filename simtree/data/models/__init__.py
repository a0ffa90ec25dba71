"""Model shape YAMLs (also under scenarios/models/)."""
