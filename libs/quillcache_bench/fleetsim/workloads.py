"""Seeded benchmark workloads: multi-tenant chat, long-document QA, one hot prefix.

Pure: token ids come from a numpy generator seeded by the caller; nothing is read or
written. A workload is a fixed sequence of requests (same for every policy and every
rate); `arrivals_us` lays Poisson arrival times over that sequence for one rate.

Block keys are exactly `block_identity(MODEL_ID, TOKENIZER_ID, cache_salt=tenant).keys(tokens,
block_size)` (the keys a gateway would send), computed incrementally: a prompt that extends an earlier one
(the next chat turn, the next question on a document) reuses the earlier prompt's
full-block keys and hashes only the blocks after them, chained from the last one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.keys import BlockIdentity, block_identity
from quillcache_core.model import CostModel, KvBlockKey, RequestShape

MODEL_ID = "llama-3-8b"
TOKENIZER_ID = "llama-3"
# Llama-3-8B in fp16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes per token.
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
VOCAB = 32_000

WORKLOAD_NAMES = ("chat", "docqa", "skewed")
DESCRIPTIONS = {
    "chat": "multi-tenant chat: 8 tenants (Zipf popularity), a shared system prompt each, "
    "multi-turn conversations (2-8 turns, each turn extends the previous prompt)",
    "docqa": "long-document QA: 4 tenants, documents of 2,000-6,000 tokens, 3-8 questions each",
    "skewed": "skewed: 80% of requests share one 2,000-token prefix; the rest are unique "
    "prompts of 8 other tenants",
}


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload: its planner shape and its answer length."""

    seq: int
    tenant: str
    group: str
    shape: RequestShape
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.shape.prompt_tokens


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    block_size: int
    requests: tuple[SimRequest, ...]

    def mean_prompt_tokens(self) -> float:
        return float(np.mean([r.prompt_tokens for r in self.requests]))

    def min_prefill_tokens(self) -> float:
        """Mean tokens a request must prefill even with a perfect, unbounded cache.

        A request reuses the longest prefix of blocks some earlier request of the
        workload already had; the rest (and the partial tail block) is computed. A
        property of the workload alone, the same for every policy.
        """
        seen: set[str] = set()
        total = 0
        for request in self.requests:
            reused = 0
            for key in request.shape.blocks:
                if key.block_hash not in seen:
                    break
                reused += key.token_count
            total += request.prompt_tokens - reused
            seen.update(key.block_hash for key in request.shape.blocks)
        return total / len(self.requests)

    def saturation_rate(self, engines: int, cost_model: CostModel) -> float:
        """Requests/s past which `engines` cannot keep up, even with a perfect cache.

        Prefill runs one request at a time per engine at `prefill_us_per_token`; each
        request needs at least `min_prefill_tokens()`. Fetches and hits are not free,
        so the real saturation point of any policy is at or below this rate.
        """
        per_request_s = self.min_prefill_tokens() * cost_model.prefill_us_per_token / 1e6
        return engines / per_request_s

    def blind_saturation_rate(self, engines: int, cost_model: CostModel) -> float:
        """Requests/s at which a fleet that reuses nothing is busy prefilling every token."""
        per_request_s = self.mean_prompt_tokens() * cost_model.prefill_us_per_token / 1e6
        return engines / per_request_s

    def arrivals_us(self, rate_per_s: float, seed: int) -> list[float]:
        """Poisson arrival times (µs, increasing) for the requests in order."""
        if rate_per_s <= 0:
            raise InvalidArgument(f"rate must be positive, got {rate_per_s}")
        rng = np.random.default_rng([seed, 7919, int(round(rate_per_s * 1000))])
        gaps = rng.exponential(1e6 / rate_per_s, size=len(self.requests))
        return np.cumsum(gaps).tolist()


@dataclass(slots=True)
class _Prompt:
    tokens: list[int]
    keys: list[KvBlockKey]  # keys of the full blocks of `tokens`


class _Chains:
    """Builds block keys for prompts, reusing the keys of a prompt they extend."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._identity: dict[str, BlockIdentity] = {}

    def root(self, tenant: str, tokens: list[int]) -> _Prompt:
        return self.extend(tenant, _Prompt([], []), tokens)

    def extend(self, tenant: str, prompt: _Prompt, more: list[int]) -> _Prompt:
        ident = self._identity.get(tenant)
        if ident is None:
            ident = self._identity[tenant] = block_identity(
                MODEL_ID, TOKENIZER_ID, cache_salt=tenant
            )
        bs = self.block_size
        tokens = prompt.tokens + more
        kept = len(prompt.tokens) // bs
        keys = prompt.keys[:kept]
        parent = keys[-1].block_hash if keys else None
        keys = keys + ident.keys(tokens[kept * bs :], bs, parent=parent or "root", first_index=kept)
        return _Prompt(tokens, keys)


def make_workload(
    name: str,
    n_requests: int,
    seed: int,
    *,
    block_size: int = 16,
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
) -> Workload:
    """The workload `name` (see WORKLOAD_NAMES) with `n_requests` requests."""
    if n_requests <= 0:
        raise InvalidArgument(f"n_requests must be positive, got {n_requests}")
    builder = _BUILDERS.get(name)
    if builder is None:
        raise InvalidArgument(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    rng = np.random.default_rng([seed, WORKLOAD_NAMES.index(name)])
    chains = _Chains(block_size)
    out: list[SimRequest] = []
    block_bytes = block_size * kv_bytes_per_token

    def emit(tenant: str, group: str, prompt: _Prompt, output_tokens: int) -> None:
        seq = len(out)
        shape = RequestShape(
            id=f"{name}-{seq}",
            model_id=MODEL_ID,
            tokenizer_id=TOKENIZER_ID,
            adapter_id=None,
            tenant_id=tenant,
            blocks=tuple(prompt.keys),
            estimated_decode_tokens=output_tokens,
            prompt_tokens=len(prompt.tokens),
            block_bytes=block_bytes,
        )
        out.append(SimRequest(seq, tenant, group, shape, output_tokens))

    builder(n_requests, rng, chains, emit)
    return Workload(name, DESCRIPTIONS[name], block_size, tuple(out))


def _tokens(rng: np.random.Generator, low: int, high: int) -> list[int]:
    """Random token ids, a length drawn uniformly from [low, high]."""
    return rng.integers(1, VOCAB, size=int(rng.integers(low, high + 1))).tolist()


def _pick(rng: np.random.Generator, weights: Sequence[float]) -> int:
    return int(rng.choice(len(weights), p=weights))


def _chat(n, rng, chains: _Chains, emit) -> None:
    tenants = [f"tenant-{i}" for i in range(8)]
    zipf = 1.0 / np.arange(1, len(tenants) + 1)
    weights = zipf / zipf.sum()
    system = {t: chains.root(t, _tokens(rng, 500, 1500)) for t in tenants}
    active: list[list] = []  # [tenant, conversation id, history prompt, turns left]
    started = 0
    while n > 0:
        while len(active) < 48:
            tenant = tenants[_pick(rng, weights)]
            active.append([tenant, f"conv-{started}", system[tenant], int(rng.integers(2, 9))])
            started += 1
        i = int(rng.integers(len(active)))
        conv = active[i]
        tenant = conv[0]
        prompt = chains.extend(tenant, conv[2], _tokens(rng, 40, 250))
        answer = _tokens(rng, 40, 300)
        emit(tenant, conv[1], prompt, len(answer))
        n -= 1
        conv[3] -= 1
        if conv[3] == 0:
            active[i] = active[-1]
            active.pop()
        else:
            conv[2] = chains.extend(tenant, prompt, answer)


def _docqa(n, rng, chains: _Chains, emit) -> None:
    tenants = [f"tenant-{i}" for i in range(4)]
    instruction = {t: chains.root(t, _tokens(rng, 100, 300)) for t in tenants}
    active: list[list] = []  # [tenant, doc id, document prompt, questions left]
    started = 0
    while n > 0:
        while len(active) < 24:
            tenant = tenants[int(rng.integers(len(tenants)))]
            doc = chains.extend(tenant, instruction[tenant], _tokens(rng, 2000, 6000))
            active.append([tenant, f"doc-{started}", doc, int(rng.integers(3, 9))])
            started += 1
        i = int(rng.integers(len(active)))
        doc = active[i]
        prompt = chains.extend(doc[0], doc[2], _tokens(rng, 15, 60))
        emit(doc[0], doc[1], prompt, int(rng.integers(20, 201)))
        n -= 1
        doc[3] -= 1
        if doc[3] == 0:
            active[i] = active[-1]
            active.pop()


def _skewed(n, rng, chains: _Chains, emit) -> None:
    hot_tenant = "tenant-hot"
    hot = chains.root(hot_tenant, _tokens(rng, 2000, 2000))
    cold_tenants = [f"tenant-{i}" for i in range(8)]
    cold_system = {t: chains.root(t, _tokens(rng, 100, 300)) for t in cold_tenants}
    for seq in range(n):
        if rng.random() < 0.8:
            prompt = chains.extend(hot_tenant, hot, _tokens(rng, 50, 300))
            emit(hot_tenant, "hot", prompt, int(rng.integers(20, 201)))
        else:
            tenant = cold_tenants[int(rng.integers(len(cold_tenants)))]
            prompt = chains.extend(tenant, cold_system[tenant], _tokens(rng, 300, 2500))
            emit(tenant, f"cold-{seq}", prompt, int(rng.integers(20, 201)))


_BUILDERS = {"chat": _chat, "docqa": _docqa, "skewed": _skewed}
