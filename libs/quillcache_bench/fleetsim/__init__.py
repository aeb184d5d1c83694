"""The fleet benchmark: seeded workloads, a discrete-event fleet simulator, its figures.

`workloads` generates requests, `sim` runs them through a simulated fleet with one
routing policy, `figures` turns a run into the benchmark's figures and goals. These
three are pure (no sockets, no disk, virtual clock; only plan latency is timed with a
clock the caller passes in). `command` is `quillcache bench` (I/O, processes, files)
and `live` drives a running local cluster over HTTP.
"""
