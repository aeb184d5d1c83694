"""Benchmarks, the fleet simulator, load generators and the demo. Runtime code never imports this package."""
