"""Cost models: the profile table, monotone latency surfaces fitted with cvxpy, and the
verify / draft cost models the simulator and planner call."""
