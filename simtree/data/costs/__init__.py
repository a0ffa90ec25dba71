"""Cost bundles (JSON) the planner and simulator use when no --costs is given."""
