"""Seeded workloads whose unique working set W outgrows the fleet's KV-cache capacity C.

Two shapes, each sized so that W is `ratio` times the capacity passed in (the sum of the
engines' KV capacity, in tokens), with Poisson arrivals at the requested request rate:

- capacity-docqa (llm-d's shared_prefix shape): G documents of 2,000-6,000 tokens, 5
  questions of 64-256 tokens each per document, short answers. Each question is a
  request of its own, a one-turn session (instruction, then "Document ...", then
  "Question: ...?") whose session id is its document's, as live_workloads' docqa does.
  W is the instruction once, every document and every question. The questions are
  shuffled, so two questions on one document are typically about G requests apart.
- capacity-chat (LMCache's multi-round QA shape): U users of R rounds after one shared
  system prompt, each user's first round opening with a long context of their own
  (2,000-4,000 tokens: their history); a session per user, whose turns the driver sends as a growing
  conversation with the engine's real answers. W is the system prompt once plus every
  user's final history, its answers counted at max_tokens. The users' rounds interleave
  in a random order that keeps each user's rounds in order.

Each workload has a warm-up phase (every document, or every conversation's first round,
once, with a four-token answer) to run unmeasured before the measured phase, and
`first_touches` names the measured requests that are a document's or conversation's
first (the cold phase when the warm-up is not run). Every answer is exactly max_tokens
long (`ignore_eos`): the decode work is fixed and the history grows as W assumes.

Token counts are the model's: the caller passes `count_tokens` (the benchmark model's
tokenizer); the text is made of the words its byte-level BPE was trained on (about a
token a word), each piece grown or trimmed until its count is within TOLERANCE_TOKENS of
its target. A run's `nonce` opens every prompt, so two runs never share a block. Pure:
the same generator state and counter give byte-identical prompts, order and times.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from quillcache_bench.live_workloads import Session, Turn
from quillcache_core.errors import InvalidArgument
from quillcache_core.launch.tiny_model import WORDS

WORKLOADS = ("capacity-docqa", "capacity-chat")
TOLERANCE_TOKENS = 2  # how far a piece's token count may be from its target
# A few tokens, not one: a random-weight model's one token can print as nothing, and a
# stream without content has no first token to time.
WARMUP_MAX_TOKENS = 4
_MAX_COUNTS = 8  # tokenizer calls a piece may take to reach its target

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class DocqaShape:
    """capacity-docqa's sizes, in tokens; ranges are inclusive (low, high)."""

    doc_tokens: tuple[int, int] = (2000, 6000)
    question_tokens: tuple[int, int] = (64, 256)
    questions_per_doc: int = 5
    answer_tokens: tuple[int, int] = (16, 64)
    instruction_tokens: int = 48


@dataclass(frozen=True)
class ChatShape:
    """capacity-chat's sizes, in tokens; ranges are inclusive (low, high)."""

    system_tokens: int = 1000
    rounds: int = 5
    # A user's own context, opening their first round (LMCache's multi-round QA gives
    # every user a long history of their own after the shared system prompt).
    history_tokens: tuple[int, int] = (2000, 4000)
    message_tokens: tuple[int, int] = (64, 256)
    answer_tokens: tuple[int, int] = (16, 64)


@dataclass(frozen=True)
class CapacityWorkload:
    """A capacity workload: `warmup` to run unmeasured first, then `measured`.

    `working_set_tokens` is W as counted by the caller's tokenizer (chat template tokens
    not included); `ratio` is the one asked for, `achieved_ratio` is W / C. `documents`
    is G for capacity-docqa (0 for chat), `users` and `rounds` are U and R for
    capacity-chat (0 for docqa)."""

    name: str
    warmup: list[Session]
    measured: list[Session]
    working_set_tokens: int
    capacity_tokens: int
    ratio: float
    documents: int = 0
    users: int = 0
    rounds: int = 0

    @property
    def achieved_ratio(self) -> float:
        return self.working_set_tokens / self.capacity_tokens


@dataclass(frozen=True)
class Request:
    """One request of a phase: turn `turn` of `sessions[session]`, touching `key` (its
    document or conversation), scheduled `at_s` seconds after the phase starts."""

    at_s: float
    session: int
    turn: int
    key: str


def schedule(sessions: Sequence[Session]) -> list[Request]:
    """Every request of `sessions` in scheduled order. A turn is scheduled at its
    session's start plus the think times up to it: the send time if answers took no
    time (the driver waits for each answer before a turn's think time)."""
    out = []
    for index, session in enumerate(sessions):
        at = session.start_s
        for turn_index, turn in enumerate(session.turns):
            at += turn.think_s
            out.append(Request(at, index, turn_index, session.session_id))
    out.sort(key=lambda r: (r.at_s, r.session, r.turn))
    return out


def first_touches(sessions: Sequence[Session]) -> list[Request]:
    """The requests of `sessions` that are the first, in scheduled order, to touch their
    document or conversation (session id): the cold ones when no warm-up ran."""
    seen: set[str] = set()
    out = []
    for request in schedule(sessions):
        if request.key not in seen:
            seen.add(request.key)
            out.append(request)
    return out


def make_capacity_workload(
    name: str,
    *,
    seed: int,
    capacity_tokens: int,
    ratio: float,
    rate_rps: float,
    nonce: str,
    count_tokens: CountTokens,
    tenant: str = "tenant-0",
) -> CapacityWorkload:
    """Workload `name` (one of WORKLOADS) with its default shape, from a generator seeded
    by (name, seed). Deterministic for (name, seed, nonce, count_tokens)."""
    if name not in WORKLOADS:
        raise InvalidArgument(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(f"{name}/{seed}")
    build = capacity_docqa if name == "capacity-docqa" else capacity_chat
    return build(
        rng,
        capacity_tokens=capacity_tokens,
        ratio=ratio,
        rate_rps=rate_rps,
        nonce=nonce,
        count_tokens=count_tokens,
        tenant=tenant,
    )


def capacity_docqa(
    rng: random.Random,
    *,
    capacity_tokens: int,
    ratio: float,
    rate_rps: float,
    nonce: str,
    count_tokens: CountTokens,
    shape: DocqaShape = DocqaShape(),
    tenant: str = "tenant-0",
) -> CapacityWorkload:
    """G documents with `shape.questions_per_doc` questions each, G chosen so that W is
    `ratio * capacity_tokens` (within a few tokens a piece, unless one smallest document
    already exceeds it). Sizes are uniform in the shape's ranges, except the last
    document's, which is fit to the target. The questions come in shuffled order at a
    Poisson rate of `rate_rps`; the warm-up asks one short question per document, in
    document order, at the same rate."""
    _check(capacity_tokens, ratio, rate_rps)
    doc_lo, doc_hi = _inner(shape.doc_tokens)
    q_lo, q_hi = _inner(shape.question_tokens)
    per_doc = shape.questions_per_doc
    if per_doc <= 0:
        raise InvalidArgument("questions_per_doc must be positive")
    target = round(ratio * capacity_tokens)
    head = f"[{nonce}] You answer questions about the document you are given. "
    instruction, instruction_n = _text(rng, head, shape.instruction_tokens, count_tokens)

    # (document tokens, question tokens, answer tokens) per document; a document that is
    # not the last leaves room for one more: a smallest document, the largest questions.
    plan: list[tuple[int, list[int], list[int]]] = []
    remaining = target - instruction_n
    while True:
        questions = [rng.randint(q_lo, q_hi) for _ in range(per_doc)]
        answers = [rng.randint(*shape.answer_tokens) for _ in range(per_doc)]
        room = remaining - sum(questions)
        if room <= doc_hi:
            plan.append((max(doc_lo, room), questions, answers))
            break
        high = max(doc_lo, min(doc_hi, room - doc_lo - per_doc * q_hi))
        doc = rng.randint(doc_lo, high)
        plan.append((doc, questions, answers))
        remaining -= doc + sum(questions)

    docs, asked, working_set = [], [], instruction_n
    for i, (doc_n, question_ns, _) in enumerate(plan):
        doc, got = _text(rng, f"Document doc-{i}:\n", doc_n, count_tokens)
        docs.append(doc)
        working_set += got
        asked.append([])
        for question_n in question_ns:
            question, got = _text(rng, "Question: ", question_n, count_tokens, tail="?")
            asked[-1].append(question)
            working_set += got

    order = [(d, q) for d in range(len(plan)) for q in range(per_doc)]
    rng.shuffle(order)
    measured = [
        _request(tenant, f"doc-{d}", at, instruction, f"{docs[d]}\n\n{asked[d][q]}", plan[d][2][q])
        for (d, q), at in zip(order, _arrivals(rng, len(order), rate_rps), strict=True)
    ]
    warmup_question = "Question: what is this document about?"
    warmup = [
        _request(tenant, f"doc-{d}", at, instruction, f"{docs[d]}\n\n{warmup_question}")
        for d, at in enumerate(_arrivals(rng, len(plan), rate_rps))
    ]
    return CapacityWorkload(
        "capacity-docqa",
        warmup,
        measured,
        working_set,
        capacity_tokens,
        ratio,
        documents=len(plan),
    )


def capacity_chat(
    rng: random.Random,
    *,
    capacity_tokens: int,
    ratio: float,
    rate_rps: float,
    nonce: str,
    count_tokens: CountTokens,
    shape: ChatShape = ChatShape(),
    tenant: str = "tenant-0",
) -> CapacityWorkload:
    """U users of `shape.rounds` rounds after one shared system prompt, U chosen so that
    W is `ratio * capacity_tokens` (within a few tokens a piece, unless one smallest
    user already exceeds it). Sizes are uniform in the shape's ranges, except the last
    user's messages, which are fit to the target. The rounds arrive at a Poisson rate of
    `rate_rps` in a random interleaving that keeps each user's rounds in order: a user's
    session starts at its first round's arrival and each later turn's think time is the
    gap to the previous round's arrival. The warm-up sends each user's first round
    once, in user order, at the same rate."""
    _check(capacity_tokens, ratio, rate_rps)
    rounds = shape.rounds
    if rounds <= 0:
        raise InvalidArgument("rounds must be positive")
    msg_lo, msg_hi = _inner(shape.message_tokens)
    answer_hi = shape.answer_tokens[1]
    target = round(ratio * capacity_tokens)
    head = f"[{nonce}] You are the assistant of a support desk; answer each user briefly. "
    system, system_n = _text(rng, head, shape.system_tokens, count_tokens)

    # (history tokens, message tokens, answer tokens) per user; a user who is not the
    # last leaves room for one more user of the smallest history and messages and the
    # longest answers. The last one's history shrinks if that is what the target needs.
    hist_lo, hist_hi = _inner(shape.history_tokens)
    plan: list[tuple[int, list[int], list[int]]] = []
    remaining = target - system_n
    while True:
        answers = [rng.randint(*shape.answer_tokens) for _ in range(rounds)]
        messages = [rng.randint(msg_lo, msg_hi) for _ in range(rounds)]
        history = rng.randint(hist_lo, hist_hi)
        flexible = remaining - sum(answers) - history
        if flexible <= rounds * msg_hi:
            if flexible < rounds * msg_lo:
                history = max(1, history - (rounds * msg_lo - flexible))
                flexible = rounds * msg_lo
            plan.append((history, _fit(messages, msg_lo, msg_hi, flexible), answers))
            break
        cap = flexible - hist_lo - rounds * (msg_lo + answer_hi)
        if sum(messages) > cap:
            messages = _fit(messages, msg_lo, msg_hi, cap)
        plan.append((history, messages, answers))
        remaining -= history + sum(messages) + sum(answers)

    texts, working_set = [], system_n
    for user, (history_n, message_ns, answers) in enumerate(plan):
        said = []
        history, _ = _text(rng, f"My account, user {user}: ", history_n, count_tokens)
        for r, message_n in enumerate(message_ns):
            message, got = _text(rng, "", message_n, count_tokens)
            if r == 0:  # the user's context opens their first message
                message = f"{history}\n\n{message}"
                got = count_tokens(message)
            said.append(message)
            working_set += got
        texts.append(said)
        working_set += sum(answers)

    slots = [u for u in range(len(plan)) for _ in range(rounds)]
    rng.shuffle(slots)
    arrivals: list[list[float]] = [[] for _ in plan]
    for user, at in zip(slots, _arrivals(rng, len(slots), rate_rps), strict=True):
        arrivals[user].append(at)
    measured = []
    for user, (said, (_, _, answers)) in enumerate(zip(texts, plan, strict=True)):
        at = arrivals[user]
        turns = tuple(
            Turn(said[r], answers[r], at[r] - at[r - 1] if r else 0.0, ignore_eos=True)
            for r in range(rounds)
        )
        measured.append(Session(tenant, f"conv-{user}", at[0], system, turns))
    measured.sort(key=lambda s: s.start_s)
    warmup = [
        _request(tenant, f"conv-{user}", at, system, texts[user][0])
        for user, at in enumerate(_arrivals(rng, len(plan), rate_rps))
    ]
    return CapacityWorkload(
        "capacity-chat",
        warmup,
        measured,
        working_set,
        capacity_tokens,
        ratio,
        users=len(plan),
        rounds=rounds,
    )


def _request(
    tenant: str, key: str, at: float, system: str, user: str, max_tokens: int = WARMUP_MAX_TOKENS
) -> Session:
    """A session of one request (its own, not part of a conversation)."""
    return Session(tenant, key, at, system, (Turn(user, max_tokens, 0.0, ignore_eos=True),))


def _check(capacity_tokens: int, ratio: float, rate_rps: float) -> None:
    if capacity_tokens <= 0:
        raise InvalidArgument(f"capacity_tokens must be positive, got {capacity_tokens}")
    if ratio <= 0:
        raise InvalidArgument(f"ratio must be positive, got {ratio}")
    if rate_rps <= 0:
        raise InvalidArgument(f"rate_rps must be positive, got {rate_rps}")


def _inner(bounds: tuple[int, int]) -> tuple[int, int]:
    """Target range for pieces whose count must land in `bounds` though a piece may miss
    its target by TOLERANCE_TOKENS."""
    low, high = bounds
    if low <= TOLERANCE_TOKENS or high - low < 2 * TOLERANCE_TOKENS:
        raise InvalidArgument(f"token range {bounds} too small")
    return low + TOLERANCE_TOKENS, high - TOLERANCE_TOKENS


def _arrivals(rng: random.Random, n: int, rate_rps: float) -> list[float]:
    """`n` increasing arrival times of a Poisson process of rate `rate_rps`."""
    out, at = [], 0.0
    for _ in range(n):
        at += rng.expovariate(rate_rps)
        out.append(at)
    return out


def _fit(values: list[int], low: int, high: int, total: int) -> list[int]:
    """`values` moved as evenly as their bounds allow so each stays in [low, high] and
    they sum to `total` (clamped to what the bounds allow)."""
    n = len(values)
    total = min(max(total, low * n), high * n)
    out = [min(max(v, low), high) for v in values]
    diff = total - sum(out)
    while diff:
        step = 1 if diff > 0 else -1
        movable = [i for i in range(n) if low <= out[i] + step <= high]
        share, extra = divmod(abs(diff), len(movable))
        for k, i in enumerate(movable):
            room = high - out[i] if step > 0 else out[i] - low
            move = min(share + (k < extra), room)
            out[i] += step * move
            diff -= step * move
    return out


def _text(
    rng: random.Random, head: str, target: int, count_tokens: CountTokens, tail: str = ""
) -> tuple[str, int]:
    """`head`, words, `tail`: about `target` tokens by `count_tokens`, and its count.
    Takes one draw from `rng` whatever the counter, so a workload's sizes, order and
    times do not depend on the tokenizer. Counts the piece a few times at most: the
    first guess is a token a word, then each guess scales by the tokens a word seen."""
    words_rng = random.Random(rng.getrandbits(64))
    words: list[str] = []
    fixed = count_tokens(head + tail)
    n = max(1, target - fixed)
    best = ("", -1)
    for _ in range(_MAX_COUNTS):
        while len(words) < n:
            words.append(words_rng.choice(WORDS))
        text = head + " ".join(words[:n]) + tail
        got = count_tokens(text)
        if best[1] < 0 or abs(got - target) < abs(best[1] - target):
            best = (text, got)
        if abs(got - target) <= TOLERANCE_TOKENS:
            break
        per_word = max(got - fixed, 1) / n
        step = round((target - got) / per_word) or (1 if target > got else -1)
        n = max(1, n + step)
    return best
