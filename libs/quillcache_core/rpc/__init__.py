"""gRPC plumbing: error mapping, health and reflection, server start, and the conductor's plan clients (PlanStream and the plan port)."""
