"""The engines' prefill speed, learned from the TTFT the gateway measures.

The cost model's compute terms (`CostModel`: 45 us a prompt token, 80 us an output
token, ...) are the seed's defaults, a GPU's order of magnitude. A real fleet is
whatever it is: vLLM on these CPUs prefills the test model at 130-800 us a token (a
core to itself, or two cores shared with another engine).
Priced at 45, the planner's queue estimate (and the conductor's prefill reservations,
released when the estimated TTFT has passed) empties twenty times too early, and under
load requests pile on the engine that holds their prefix.

Every request that loads nothing from the pool is a sample: the prefill tokens it left
to compute plus those queued ahead of it on its engine when it was planned (counted by
the reservations of every replica, not estimated), against its measured TTFT. An engine
batches the prefills it holds (vLLM's chunked prefill), so a request's first token waits
for about the tokens ahead of it and its own; and a busy engine's samples are the ones
that spread the token counts out. A robust line through the recent samples
(`PrefillSpeed`) gives the time a prefill token costs (the slope) beside a fixed part
(the intercept: HTTP, scheduling, tokenizing, the first decode step), which the
conductor adds to a plan's estimated TTFT when it releases the plan's queued prefill.
The count ahead is what the reservations still hold: a streamed request's until the
gateway reports its first token, a whole answer's until its estimated TTFT. Released at
estimates that are too low, a request that waited behind work already released paired a
small count with a long TTFT and flattened the median slope instead of raising it (on
real vLLM the speed fell to the floor this way: README). Split requests are no samples
(their TTFT is another engine's prefill). (The first design took samples only from idle
engines: on vLLM here their TTFTs were mostly the intercept and its noise, and the slope
read 4-49 us a token where a 1,024-token prefill alone costs about 160 us a token.)

A request planned on an idle engine that loads blocks from the pool teaches the price
of fetching (`FetchPrice`), once the prefill line is known: what its TTFT holds beyond
the line's intercept and its recomputed tokens, over what the default cost model prices
its fetches at, is the factor that price is off by (vLLM's connector on these CPUs
loads a block from a peer store node in about 6 ms, which the default prices at 55 us).
The median of the last 32 such factors is used, never below 1: the defaults are a GPU
server's prices (DMA from host DRAM, RDMA from a peer), which a fleet does not beat.
Without that floor a line whose intercept outgrew the fetching requests' TTFTs (real
vLLM here: TTFTs of 30-40 ms with a fixed part and outliers of 180) read every factor
as at most 0, the median went to the clamp (0.005), fetches looked free, and the
planner sent most document questions to the other engine to load 50-60 blocks from
the pool (`bench-live --engine vllm` docqa: 69 of 90 plans fetched, estimated at 1 ms,
taking 91 ms).

`scaled` derives the cost model the planner then uses: the learned prefill speed, and
every other compute term of the engines (queue, decode, hits, the running-decode
penalty) scaled by the same ratio against the default; every transfer price (the
tiers' us per MB, the cross-domain penalty) times the learned fetch factor.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque

import numpy as np

from quillcache_core.model import CostModel

logger = logging.getLogger(__name__)

__all__ = ["FetchPrice", "ModelSpeeds", "PrefillSpeed", "scaled"]

# The learned speed stays within this factor of the default either way (a CPU test fleet
# at time scale 0.02 is 1/50 of it, vLLM on CPU about 20x).
MAX_FACTOR = 200.0
# A fetch is never priced below the cost model's default (see the module docstring).
MIN_FETCH_FACTOR = 1.0


def median_of(values: np.ndarray) -> float:
    """np.median of a non-empty array without NaNs, by a partial sort: the same value,
    without np.median's NaN check (whose first call imports numpy.ma, a stall of tens of
    milliseconds inside a live conductor's first refit) and its per-call overhead."""
    n = len(values)
    half = n // 2
    if n % 2:
        return float(np.partition(values, half)[half])
    part = np.partition(values, (half - 1, half))
    return float((part[half - 1] + part[half]) / 2)


class PrefillSpeed:
    """Prefill us per token for one model's engines, from (tokens, TTFT) samples.

    A Theil-Sen fit over the last `window` samples: the median of the slopes between a
    sample of the shorter half and one of the longer half (token counts at least a tenth
    of their mean apart), and the median intercept under it. A stall of seconds (another
    engine on the same cores, a scheduler hiccup) moves a median by one rank, where it
    would drag a least-squares line anywhere. Pairing short with long measures what a
    long prefill costs a token: on a CPU, attention makes a token of a long prompt
    dearer than one of a short prompt, and the queue a long prefill makes is what the
    planner must not underestimate. Refitted every `every` samples.
    """

    def __init__(
        self,
        default_us_per_token: float,
        window: int = 64,
        min_samples: int = 16,
        every: int = 4,
    ) -> None:
        if default_us_per_token <= 0:
            raise ValueError("default_us_per_token must be positive")
        self.default = float(default_us_per_token)
        self.min_samples = min_samples
        self.every = every
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)
        self.samples = 0
        self.us_per_token = self.default
        self.intercept_us = 0.0
        self.fitted = False  # a line was fitted (else the default, no intercept)

    def observe(self, tokens: int, ttft_us: float) -> bool:
        """Add one sample; returns True when the estimate changed."""
        if tokens < 0 or not (0.0 < ttft_us < math.inf):
            return False
        self._recent.append((float(tokens), float(ttft_us)))
        self.samples += 1
        if len(self._recent) < self.min_samples or self.samples % self.every:
            return False
        # Every (shorter half, longer half) pair at once, in numpy: the same slopes and
        # medians as a loop over the pairs (up to 1,024 of them every `every` samples
        # was a conductor's largest cost of a Finish).
        xs, ys = np.array(sorted(self._recent)).T
        gap = 0.1 * sum(xs.tolist()) / len(xs)
        half = len(xs) // 2
        dx = xs[half:] - xs[:half, None]
        dy = ys[half:] - ys[:half, None]
        pairs = (dx >= gap) & (dx > 0)
        # Too little spread in the token counts to tell the slope from the intercept.
        if int(pairs.sum()) < self.min_samples:
            return False
        slope = median_of(dy[pairs] / dx[pairs])
        if not slope > 0:
            return False
        slope = min(max(slope, self.default / MAX_FACTOR), self.default * MAX_FACTOR)
        self.intercept_us = max(0.0, median_of(ys - slope * xs))
        self.fitted = True
        changed = abs(slope - self.us_per_token) > 0.01 * self.us_per_token
        if changed:
            self.us_per_token = slope
        return changed


class FetchPrice:
    """How far off the default cost model's fetch prices are: the median of the last
    `window` measured factors (1 until `min_samples` of them)."""

    def __init__(self, window: int = 32, min_samples: int = 8) -> None:
        self.min_samples = min_samples
        self._recent: deque[float] = deque(maxlen=window)
        self.samples = 0
        self.factor = 1.0

    def observe(self, factor: float) -> bool:
        """Add one measured factor; returns True when the estimate changed."""
        if not math.isfinite(factor):
            return False
        self._recent.append(min(max(factor, MIN_FETCH_FACTOR), MAX_FACTOR))
        self.samples += 1
        if len(self._recent) < self.min_samples:
            return False
        median = statistics.median(self._recent)
        changed = abs(median - self.factor) > 0.01 * self.factor
        if changed:
            self.factor = median
        return changed


def scaled(base: CostModel, us_per_token: float, fetch_factor: float = 1.0) -> CostModel:
    """`base` with its prefill speed at `us_per_token`, the engines' other compute terms
    scaled alike and its transfer prices times `fetch_factor` (see the module docstring)."""
    factor = us_per_token / base.prefill_us_per_token
    return dataclasses.replace(
        base,
        prefill_us_per_token=us_per_token,
        queue_us_per_prefill_token=base.queue_us_per_prefill_token * factor,
        decode_us_per_token=base.decode_us_per_token * factor,
        running_decode_penalty_us=base.running_decode_penalty_us * factor,
        hbm_hit_us=base.hbm_hit_us * factor,
        remote_hbm_us_per_mb=base.remote_hbm_us_per_mb * fetch_factor,
        cpu_dram_us_per_mb=base.cpu_dram_us_per_mb * fetch_factor,
        local_ssd_us_per_mb=base.local_ssd_us_per_mb * fetch_factor,
        object_store_us_per_mb=base.object_store_us_per_mb * fetch_factor,
        cross_domain_penalty_us=base.cross_domain_penalty_us * fetch_factor,
    )


class ModelSpeeds:
    """Per model: its engines' learned prefill speed and fetch price, and the cost model
    it prices with."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self.speeds: dict[str, PrefillSpeed] = {}
        self.fetches: dict[str, FetchPrice] = {}
        self._cost_models: dict[str, CostModel] = {}

    def cost_model(self, model_id: str) -> CostModel:
        return self._cost_models.get(model_id, self.base)

    def intercept_us(self, model_id: str) -> float:
        """The fixed part of the model's TTFTs (0 until a line is fitted)."""
        speed = self.speeds.get(model_id)
        return speed.intercept_us if speed is not None and speed.fitted else 0.0

    def fetch_factor(self, model_id: str) -> float:
        price = self.fetches.get(model_id)
        return price.factor if price is not None else 1.0

    def observe(self, model_id: str, tokens: int, ttft_us: float, fetch_us: float = 0.0) -> None:
        """One sample: `tokens` recomputed, `ttft_us` measured and, for a request that
        loaded blocks, `fetch_us` (> 0) what the default cost model prices its fetches at."""
        speed = self.speeds.get(model_id)
        if speed is None:
            speed = self.speeds[model_id] = PrefillSpeed(self.base.prefill_us_per_token)
        if fetch_us <= 0:
            changed = speed.observe(tokens, ttft_us)
        else:
            if not speed.fitted:
                return
            price = self.fetches.get(model_id)
            if price is None:
                price = self.fetches[model_id] = FetchPrice()
            over = ttft_us - speed.intercept_us - speed.us_per_token * tokens
            changed = price.observe(over / fetch_us)
        if changed:
            factor = self.fetch_factor(model_id)
            self._cost_models[model_id] = scaled(self.base, speed.us_per_token, factor)
            logger.debug(
                "%s: prefill %.1f us a token (+ %.1f ms a request), fetches at %.2fx",
                model_id or "(no model)",
                speed.us_per_token,
                speed.intercept_us / 1000,
                factor,
            )
