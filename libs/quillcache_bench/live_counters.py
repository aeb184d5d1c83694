"""bench-live's reading of the cluster's counters around a run: the gateway's plan
fallbacks and where its time went (its /metrics sums), the vLLM connectors' store
lookups, and what the conductors learned."""

from __future__ import annotations

from quillcache_bench.live_systems import metric_sum, metric_text
from quillcache_core.security.credentials import operator_context


def metric_sums(endpoints: dict, url: str | None, names) -> dict[str, float]:
    """The sum of each of `names` on one /metrics page (empty if it cannot be read)."""
    if url is None:
        return {}
    try:
        text = metric_text(url, operator_context(endpoints))
    except (OSError, ValueError):
        return {}
    return {name: metric_sum(text, name) for name in names}


# Requests the gateway routed without the conductor (its Plan too slow or failing).
FALLBACKS = "quillcache_gateway_plan_fallbacks_total"
# Where a request's time went in the gateway, from its /metrics: (sum, count) metrics.
STAGES = {
    "prepare": ("quillcache_gateway_prepare_seconds_sum", "quillcache_gateway_ttft_seconds_count"),
    "plan": ("quillcache_gateway_plan_seconds_sum", "quillcache_gateway_plan_seconds_count"),
    "engine_head": (
        "quillcache_gateway_engine_head_seconds_sum",
        "quillcache_gateway_engine_head_seconds_count",
    ),
    "first_byte": ("quillcache_gateway_ttft_seconds_sum", "quillcache_gateway_ttft_seconds_count"),
}


def gateway_counters(endpoints: dict) -> dict[str, float]:
    """The gateway's plan fallbacks and stage sums and counts so far, from one read of
    its /metrics (empty if it cannot be read)."""
    names = {FALLBACKS, *(name for pair in STAGES.values() for name in pair)}
    return metric_sums(endpoints, endpoints["metrics"].get("gateway"), names)


def plan_fallbacks(before: dict[str, float], after: dict[str, float]) -> float:
    """Plan fallbacks between two `gateway_counters`; -1 if either could not be read."""
    if FALLBACKS in before and FALLBACKS in after:
        return after[FALLBACKS] - before[FALLBACKS]
    return -1.0


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per stage, its mean over the run in ms: from the arrival to the Plan call
    (read, validate, tokenize, hash), the Plan call, the engine's answer head, and the
    first byte of the answer from the arrival (the gateway's own TTFT)."""
    means = {}
    for stage, (total, count) in STAGES.items():
        if total in before and total in after:
            n = after[count] - before[count]
            if n > 0:
                means[stage] = round(1000 * (after[total] - before[total]) / n, 2)
    return means


# The vLLM connectors' scheduler sides: their store lookups over a run (QuillCache's
# planned requests ask none; behind a router the connector is bypassed: none either).
LOOKUPS = {
    "connector_store_lookups": "quillcache_connector_lookups_total",
    "connector_lookup_s": "quillcache_connector_lookup_seconds_total",
}


def connector_lookups(endpoints: dict) -> dict[str, float]:
    """LOOKUPS so far, summed over the engines' connectors (empty with sim engines)."""
    total: dict[str, float] = {}
    for name, url in endpoints["metrics"].items():
        if name.endswith("-connector-scheduler"):
            sums = metric_sums(endpoints, url, LOOKUPS.values())
            for field, metric in LOOKUPS.items():
                if metric in sums:
                    total[field] = total.get(field, 0.0) + sums[metric]
    return total


LEARNED = {
    "prefill_us_per_token": "quillcache_prefill_seconds_per_token",
    "prefill_samples": "quillcache_prefill_samples_total",
    "fetch_price_factor": "quillcache_fetch_price_factor",
}


def learned(endpoints: dict) -> dict[str, dict[str, float]]:
    """What each conductor replica has learned of the engines so far (its /metrics):
    the prefill speed its plans are priced at, from how many samples, and the fetch
    price factor."""
    found = {}
    for name, url in endpoints["metrics"].items():
        if name.startswith("conductor"):
            sums = metric_sums(endpoints, url, LEARNED.values())
            if sums:
                found[name] = {key: sums[metric] for key, metric in LEARNED.items()}
                found[name]["prefill_us_per_token"] *= 1e6  # /metrics has it in seconds
    return found
