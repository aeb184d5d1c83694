"""Routing: the cost model and our planner, the reference policies, the reuse guard, and one routing decision."""
