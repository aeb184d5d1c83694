"""The benchmark and demo commands `quillcache` offers when this package is installed.

Read by `quillcache_core.launch.cli` through the `quillcache.commands` entry-point
group (pyproject.toml); each module is imported only when its command runs.
"""

# name -> (module with a `main(argv) -> int`, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench-store": (
        "quillcache_bench.store",
        "store and transfer throughput against raw TCP, bare gRPC and fsync'd writes",
    ),
    "bench-conductor": (
        "quillcache_bench.conductor",
        "Plan over gRPC (latency, plans/s) and KV-event ingest, in-process and over ZMQ",
    ),
    "bench-connector": (
        "quillcache_bench.kv_connector",
        "TTFT of a long prompt on real vLLM: recompute vs KV loaded from DRAM, SSD, a peer",
    ),
    "bench-gateway": (
        "quillcache_bench.gateway",
        "latency the gateway adds over calling an engine directly (p50/p99)",
    ),
    "demo": (
        "quillcache_bench.demo",
        "start a real etcd, register a small fleet, plan requests with every policy",
    ),
    "bench-planner": (
        "quillcache_bench.planner",
        "planner latency per policy and index put/locate rates at 1M resident blocks",
    ),
    "bench-index": (
        "quillcache_bench.index_bench",
        "residency-index backends (memory, lmdb, rocksdb, fs, art) on the same traces",
    ),
    "chaos": (
        "quillcache_bench.chaos",
        "load while one process at a time is killed or stalled: failures, late ones, blocks lost",
    ),
    "bench": (
        "quillcache_bench.fleetsim.command",
        "our planner vs Dynamo, llm-d, SGLang, round robin, least-loaded on a simulated fleet",
    ),
    "bench-live": (
        "quillcache_bench.live_bench",
        "live TTFT vs the real sglang-router and vllm-router in front of the same engines",
    ),
    "bench-inference-perf": (
        "quillcache_bench.inference_perf",
        "the capacity race's docqa shape driven by inference-perf, QuillCache against SMG",
    ),
    "bench-idle": (
        "quillcache_bench.idle",
        "CPU of every process of an idle `quillcache up` cluster over 60 s (/proc)",
    ),
    "bench-disagg": (
        "quillcache_bench.disagg",
        "prefill/decode disaggregation vs colocated on a decode-heavy load: TTFT, inter-token",
    ),
}
