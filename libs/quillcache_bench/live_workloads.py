"""`quillcache bench-live`'s workloads as text, and the client that drives them.

Three seeded workloads, each a list of sessions with start times (Poisson over the
requested request rate) and the turns each session sends:

- chat: 8 tenants of Zipf popularity, each with its own system prompt (400-1,000
  words); conversations of 2-5 turns, each turn sending the whole conversation so far
  with the engine's real answers (as `fleetsim.live` does), a short think time between
  turns;
- docqa: 4 tenants; long documents (1,500-3,500 words) that several users ask about: a
  pool of 6 open documents, 3-8 questions each, each question a request of its own
  (instruction, document, question);
- mix: the two at once over 6 tenants, half the sessions each;
- decode: decode-heavy, for prefill/decode disaggregation: 4 tenants, each
  request one turn of its own (a tenant's short instruction, then a distinct task of
  500-900 words, about 1,000-1,800 tokens) asking for 200-400 output tokens with
  `ignore_eos` (the sim engine always writes `max_tokens`). Its samples keep the gaps
  between the stream's content chunks (inter-token latency).

The builtin tokenizer of the sim engine counts a word and the space after it as two
tokens. The text is made of words `w<n>`; a run's `nonce` opens every prompt, so two
runs (two systems, two cells) never share a block and each system starts cold.

The client sends OpenAI chat requests (streaming) with the tenant's API key and an
`X-Session-ID` header naming the session (the conversation, or the document asked
about): the header vLLM router's consistent_hash keys on; the other systems ignore it.
TTFT is from sending the request to the first chunk with content. To QuillCache's
gateway (`Target.explain`) a request also asks `x-quillcache-explain: 1` and the
stream's usage: each sample keeps the plan's predicted and the engine's delivered
cached tokens and TTFT (the `quillcache` object of the last event) and its prompt tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from quillcache_bench.common import read_chat_stream
from quillcache_bench.disagg import inter_token_s
from quillcache_core.errors import InvalidArgument

WORKLOADS = ("chat", "docqa", "mix", "decode")
# Workloads whose samples carry inter-token gaps (their streams are long).
ITL_WORKLOADS = ("decode",)
REQUEST_TIMEOUT_S = 120.0
EXPLAIN_HEADER = "x-quillcache-explain"  # the gateway's (quillcache_gateway.delivered)
EXPLAIN_FIELD = "quillcache"
EXPLAIN_MARK = b'"predicted"'


@dataclass(frozen=True)
class Turn:
    user: str  # the user's message
    max_tokens: int
    think_s: float  # pause before this turn (after the previous answer)
    ignore_eos: bool = False  # write max_tokens whatever the model says (decode workload)


@dataclass(frozen=True)
class Session:
    tenant: str
    session_id: str
    start_s: float
    system: str
    turns: tuple[Turn, ...]


@dataclass
class Sample:
    tenant: str
    sent_s: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    done_s: float = 0.0
    ok: bool = False
    error: str = ""
    itl_s: list[float] = field(default_factory=list)  # inter-token gaps (decode workload)
    prefill_ms: float = 0.0  # a split's prefill call, as QuillCache's gateway timed it
    disagg: str = ""  # QuillCache's x-quillcache-disagg answer, up to its first ';' (or fallback)
    plan: dict[str, str] = field(default_factory=dict)  # QuillCache's x-quillcache-* headers
    session: str = ""  # the session's id (the conversation, or the document asked about)
    explain: dict = field(default_factory=dict)  # QuillCache's `quillcache` object (explain)
    prompt_tokens: int = 0  # from the stream's usage, when it had one


def _words(rng: random.Random, low: int, high: int, scale: float = 1.0) -> str:
    low, high = max(1, int(low * scale)), max(1, int(high * scale))
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(rng.randint(low, high)))


def make_sessions(
    name: str,
    n_requests: int,
    rate_rps: float,
    seed: int,
    nonce: str,
    think_scale: float = 1.0,
    size_scale: float = 1.0,
) -> list[Session]:
    """The sessions of workload `name` with `n_requests` turns in all, starting as a
    Poisson process whose request rate is `rate_rps` (sessions arrive at that rate
    divided by the mean turns a session). Deterministic for (name, n, seed, nonce).
    `size_scale` multiplies every text length (e.g. to fit a small model's context)."""
    if name not in WORKLOADS:
        raise InvalidArgument(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if n_requests <= 0 or rate_rps <= 0:
        raise InvalidArgument("requests and rate must be positive")
    rng = random.Random(f"{name}/{seed}")
    head = f"[{nonce}] "
    if name == "chat":
        sessions = _chat(
            rng, n_requests, head, [f"tenant-{i}" for i in range(8)], think_scale, size_scale
        )
    elif name == "docqa":
        sessions = _docqa(rng, n_requests, head, [f"tenant-{i}" for i in range(4)], size_scale)
    elif name == "decode":
        sessions = _decode(rng, n_requests, head, [f"tenant-{i}" for i in range(4)], size_scale)
    else:
        tenants = [f"tenant-{i}" for i in range(6)]
        chat_rng, doc_rng = random.Random(rng.random()), random.Random(rng.random())
        sessions = _chat(chat_rng, max(1, n_requests // 2), head, tenants, think_scale, size_scale)
        chat_turns = sum(len(s.turns) for s in sessions)
        if n_requests > chat_turns:
            sessions += _docqa(doc_rng, n_requests - chat_turns, head, tenants, size_scale)
        rng.shuffle(sessions)
    turns = sum(len(s.turns) for s in sessions)
    session_rate = rate_rps * len(sessions) / turns
    start = 0.0
    timed = []
    for s in sessions:
        start += rng.expovariate(session_rate)
        timed.append(Session(s.tenant, s.session_id, start, s.system, s.turns))
    return timed


def _chat(rng, n, head, tenants, think_scale, scale) -> list[Session]:
    weights = [1.0 / (i + 1) for i in range(len(tenants))]
    system = {
        t: head
        + f"You are the assistant of {t}. "
        + _words(random.Random(f"sys/{t}"), 400, 1000, scale)
        for t in tenants
    }
    out = []
    while n > 0:
        tenant = rng.choices(tenants, weights)[0]
        count = min(n, rng.randint(2, 5))
        n -= count
        turns = tuple(
            Turn(
                _words(rng, 20, 80, scale), rng.randint(32, 96), rng.uniform(0.1, 0.5) * think_scale
            )
            for _ in range(count)
        )
        out.append(Session(tenant, f"conv-{len(out)}", 0.0, system[tenant], turns))
    return out


def _docqa(rng, n, head, tenants, scale) -> list[Session]:
    instruction = {
        t: head + f"You answer {t}'s questions about documents. " + _words(rng, 50, 150, scale)
        for t in tenants
    }
    open_docs: list[list] = []  # [tenant, doc id, text, questions left]
    made = 0
    out = []
    for _ in range(n):
        while len(open_docs) < 6:
            tenant = rng.choice(tenants)
            open_docs.append(
                [tenant, f"doc-{made}", _words(rng, 1500, 3500, scale), rng.randint(3, 8)]
            )
            made += 1
        doc = rng.choice(open_docs)
        question = f"Document:\n{doc[2]}\n\nQuestion: {_words(rng, 8, 30, scale)}?"
        out.append(
            Session(
                doc[0],
                doc[1],
                0.0,
                instruction[doc[0]],
                (Turn(question, rng.randint(20, 100), 0.0),),
            )
        )
        doc[3] -= 1
        if doc[3] == 0:
            open_docs.remove(doc)
    return out


def _decode(rng, n, head, tenants, scale) -> list[Session]:
    instruction = {
        t: head + f"You write long answers for {t}. " + _words(rng, 30, 60, scale) for t in tenants
    }
    out = []
    for i in range(n):
        tenant = rng.choice(tenants)
        task = f"Task {i}: {_words(rng, 500, 900, scale)}\nWrite at length."
        turn = Turn(task, rng.randint(200, 400), 0.0, ignore_eos=True)
        out.append(Session(tenant, f"task-{i}", 0.0, instruction[tenant], (turn,)))
    return out


def working_set_tokens(
    sessions: list[Session],
    tokens_per_word: float = 2.0,
    count: Callable[[str], int] | None = None,
) -> int:
    """The sessions' distinct prompt tokens, estimated: every distinct paragraph of the
    system prompts and user turns (a document asked about again counts once), its
    tokens as `count` tells (a model's tokenizer) or its words times `tokens_per_word`
    (the sim engine's built-in tokenizer: 2), and the answers later turns carry (their
    max_tokens)."""
    seen: set[str] = set()
    tokens = 0.0
    answers = 0
    for session in sessions:
        for text in (session.system, *(t.user for t in session.turns)):
            for part in text.split("\n\n"):
                if part not in seen:
                    seen.add(part)
                    tokens += count(part) if count else len(part.split()) * tokens_per_word
        answers += sum(t.max_tokens for t in session.turns[:-1])
    return round(tokens) + answers


@dataclass
class Target:
    """Where a system takes requests: its base URL, how to verify it, each tenant's key."""

    url: str
    ssl_context: ssl.SSLContext | None
    api_keys: dict[str, str] = field(default_factory=dict)
    model: str = "sim-model"
    explain: bool = False  # QuillCache's gateway: ask for its predicted-vs-delivered figures


async def drive(
    target: Target,
    sessions: list[Session],
    *,
    on_done: Callable[[], None] = lambda: None,
    cutoff_s: float = float("inf"),
    stop: threading.Event | None = None,
) -> list[Sample]:
    """Run every session against `target`; a turn that would start after `cutoff_s`
    (seconds from the start), or once `stop` is set (from any thread), is not sent.
    Returns one sample per request sent."""
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(
        limit=0, ssl=target.ssl_context if target.ssl_context is not None else False
    )
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        began = time.perf_counter()

        async def run(session: Session) -> None:
            while (wait := session.start_s - (time.perf_counter() - began)) > 0:
                if stop is not None and stop.is_set():
                    return
                await asyncio.sleep(wait if stop is None else min(wait, 0.5))
            messages = [{"role": "system", "content": session.system}]
            for turn in session.turns:
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                if time.perf_counter() - began > cutoff_s or (stop is not None and stop.is_set()):
                    return
                messages.append({"role": "user", "content": turn.user})
                sample, answer = await _one(http, target, session, messages, turn)
                samples.append(sample)
                on_done()
                messages.append({"role": "assistant", "content": answer or "ok"})

        await asyncio.gather(*(run(s) for s in sessions))
    return samples


async def _one(http, target: Target, session: Session, messages, turn: Turn) -> tuple[Sample, str]:
    sample = Sample(session.tenant, session=session.session_id)
    key = target.api_keys.get(session.tenant, "none")
    headers = {"Authorization": f"Bearer {key}", "X-Session-ID": session.session_id}
    body = {
        "model": target.model,
        "messages": messages,
        "max_tokens": turn.max_tokens,
        "stream": True,
    }
    if turn.ignore_eos:
        body["ignore_eos"] = True
    if target.explain:
        headers[EXPLAIN_HEADER] = "1"
        body["stream_options"] = {"include_usage": True}
    answer = ""
    sample.sent_s = time.perf_counter()
    try:
        async with http.post(
            f"{target.url}/v1/chat/completions", json=body, headers=headers
        ) as reply:
            with contextlib.suppress(ValueError):
                sample.prefill_ms = float(reply.headers.get("x-quillcache-prefill-ms", 0) or 0)
            sample.plan = {
                k[13:]: v for k, v in reply.headers.items() if k.lower().startswith("x-quillcache-")
            }
            disagg = reply.headers.get("x-quillcache-disagg", "")
            sample.disagg = "fallback" if "fallback" in disagg else disagg.split(";", 1)[0]
            if reply.status != 200:
                sample.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
            else:
                tapped = turn.ignore_eos or target.explain
                lines = _Timed(reply.content) if tapped else reply.content
                answer, usage = await read_chat_stream(lines, sample.sent_s, sample)
                if turn.ignore_eos:
                    sample.itl_s = inter_token_s(lines.content_arrivals())
                if target.explain:
                    sample.explain = lines.explained()
                    if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int:
                        sample.prompt_tokens = usage["prompt_tokens"]
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        sample.error = repr(exc)[:200]
    sample.done_s = time.perf_counter()
    if sample.ok and sample.ttft_s is None:
        sample.ok = False
        sample.error = "stream ended without content"
    return sample, answer


class _Timed:
    """A stream's lines as `read_chat_stream` reads them, each one's arrival noted: the
    times of the chunks with content (for the gaps between tokens), and the gateway's
    `quillcache` object (explain) of the event that carries it."""

    def __init__(self, content) -> None:
        self._lines = content.__aiter__()
        self._seen: list[tuple[float, bytes]] = []

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        raw = await self._lines.__anext__()
        if raw.startswith(b"data:"):
            self._seen.append((time.perf_counter(), raw))
        return raw

    def explained(self) -> dict:
        """The last event's `quillcache` object with predicted and delivered figures."""
        for _, raw in reversed(self._seen):
            if EXPLAIN_MARK not in raw:
                continue
            try:
                found = json.loads(raw[5:]).get(EXPLAIN_FIELD)
            except (ValueError, AttributeError):
                continue
            if isinstance(found, dict) and "predicted" in found:
                return found
        return {}

    def content_arrivals(self) -> list[float]:
        out = []
        for at, raw in self._seen:
            try:
                chunk = json.loads(raw[5:])
            except ValueError:
                continue  # [DONE]
            if not isinstance(chunk, dict):
                continue
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                out.append(at)
        return out
