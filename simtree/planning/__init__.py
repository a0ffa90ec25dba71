"""Policies, the decode-throughput simulator and the planner that chooses a policy per workload
and batch size."""
