"""The fleet benchmark: seeded workloads, a discrete-event fleet simulator, its figures.

`workloads` generates requests, `sim` runs them through a simulated fleet with one
routing policy (`caches`: an engine's HBM and a store node's tiers), `figures` turns a
run into the benchmark's figures and goals. These are pure (no sockets, no disk, virtual clock; only plan latency is timed with a
clock the caller passes in). `command` is `quillcache bench` (I/O, processes, files)
and `live` drives a running local cluster over HTTP.
"""
