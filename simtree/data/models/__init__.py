"""Model shape YAMLs (scenarios/models/ holds links to these files)."""
