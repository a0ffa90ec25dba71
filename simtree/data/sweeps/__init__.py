"""Profile sweeps (YAML); scenarios/sweeps/ holds links to these files."""
