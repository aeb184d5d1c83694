import functools
import random
import statistics
import time
from collections import Counter, defaultdict

import pytest

from quillcache_bench.capacity_workloads import (
    WARMUP_MAX_TOKENS,
    ChatShape,
    capacity_chat,
    capacity_docqa,
    first_touches,
    make_capacity_workload,
    schedule,
)
from quillcache_core.errors import InvalidArgument

pytestmark = pytest.mark.unit

ENGINES = 2
PER_ENGINE_TOKENS = 12_288
CAPACITY = ENGINES * PER_ENGINE_TOKENS
NAMES = ("capacity-docqa", "capacity-chat")


def words(text: str) -> int:
    return len(text.split())


@functools.cache  # a workload is immutable; tests share them
def workload(name="capacity-docqa", seed=7, ratio=2.0, count=words, nonce="run-1", rate=4.0):
    return make_capacity_workload(
        name,
        seed=seed,
        capacity_tokens=CAPACITY,
        ratio=ratio,
        rate_rps=rate,
        nonce=nonce,
        count_tokens=count,
    )


def doc_and_question(session):
    document, question = session.turns[0].user.split("\n\n")
    return document, question


def recount_docqa(w, count) -> int:
    """W from the prompts themselves: the instruction once, each document once, every
    question."""
    documents = {doc_and_question(s)[0] for s in w.measured}
    questions = [doc_and_question(s)[1] for s in w.measured]
    return (
        count(w.measured[0].system)
        + sum(count(d) for d in documents)
        + sum(count(q) for q in questions)
    )


def recount_chat(w, count) -> int:
    """W from the prompts: the system prompt once, each user's messages and answers."""
    turns = [t for s in w.measured for t in s.turns]
    return count(w.measured[0].system) + sum(count(t.user) + t.max_tokens for t in turns)


def distinct_between(keys: list[str]) -> list[int]:
    """For each two consecutive requests on one key, how many other keys came between."""
    last: dict[str, int] = {}
    out = []
    for i, key in enumerate(keys):
        if key in last:
            out.append(len(set(keys[last[key] + 1 : i]) - {key}))
        last[key] = i
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_seed_gives_the_same_workload_and_another_seed_a_different_one(name):
    first, again, other = workload(name, seed=3), workload(name, seed=3), workload(name, seed=4)
    assert first == again
    assert first.measured != other.measured
    assert [s.start_s for s in first.measured] != [s.start_s for s in other.measured]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ratio", [0.5, 1.0, 2.0, 4.0])
def test_the_working_set_is_the_asked_multiple_of_the_capacity(name, ratio):
    w = workload(name, ratio=ratio)
    recount = recount_docqa if name == "capacity-docqa" else recount_chat
    assert w.working_set_tokens == recount(w, words)
    assert w.capacity_tokens == CAPACITY and w.ratio == ratio
    assert w.achieved_ratio == pytest.approx(ratio, rel=0.03)


@pytest.mark.parametrize("ratio", [0.5, 4.0])
def test_docqa_sizes_are_in_their_ranges_with_five_questions_a_document(ratio):
    w = workload("capacity-docqa", ratio=ratio)
    per_document = Counter(s.session_id for s in w.measured)
    assert len(per_document) == w.documents
    assert set(per_document.values()) == {5}
    for session in w.measured:
        document, question = doc_and_question(session)
        assert 2000 <= words(document) <= 6000
        assert 64 <= words(question) <= 256
        assert 16 <= session.turns[0].max_tokens <= 64
        assert len(session.turns) == 1 and session.turns[0].think_s == 0.0
    lengths = {words(doc_and_question(s)[0]) for s in w.measured}
    assert len(lengths) == w.documents  # drawn, not one fixed size


def test_chat_sizes_are_in_their_ranges_with_every_user_of_r_rounds():
    w = workload("capacity-chat", ratio=4.0)
    assert len(w.measured) == w.users and w.rounds == ChatShape().rounds
    assert len({s.session_id for s in w.measured}) == w.users
    assert len({s.system for s in w.measured}) == 1
    assert 998 <= words(w.measured[0].system) <= 1002
    for session in w.measured:
        assert len(session.turns) == w.rounds
        history, first = session.turns[0].user.split("\n\n")
        assert 2000 <= words(history) <= 4000 or session.session_id == f"conv-{w.users - 1}"
        assert 64 <= words(first) <= 256
        for turn in session.turns:
            assert 64 <= words(turn.user.split("\n\n")[-1]) <= 256
            assert 16 <= turn.max_tokens <= 64
            assert turn.ignore_eos


@pytest.mark.parametrize("name", NAMES)
def test_arrivals_increase_with_a_mean_gap_near_one_over_the_rate(name):
    rate = 5.0
    w = workload(name, ratio=4.0, rate=rate)
    times = [r.at_s for r in schedule(w.measured)]
    assert len(times) > 80
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.25)


@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_docqa_questions_on_a_document_are_further_apart_than_one_engine_holds(ratio):
    w = workload("capacity-docqa", ratio=ratio)
    keys = [r.key for r in schedule(w.measured)]
    consecutive_same = sum(a == b for a, b in zip(keys, keys[1:], strict=False))
    assert consecutive_same < 0.1 * len(keys)
    documents_per_engine = PER_ENGINE_TOKENS / (w.working_set_tokens / w.documents)
    assert statistics.median(distinct_between(keys)) > documents_per_engine


def test_chat_rounds_keep_each_user_s_order_and_interleave_users():
    w = workload("capacity-chat", ratio=4.0)
    order = schedule(w.measured)
    turns_seen: dict[int, list[int]] = defaultdict(list)
    for request in order:
        turns_seen[request.session].append(request.turn)
    assert all(t == list(range(w.rounds)) for t in turns_seen.values())
    keys = [r.key for r in order]
    assert sum(a == b for a, b in zip(keys, keys[1:], strict=False)) < 0.1 * len(keys)
    users_per_engine = PER_ENGINE_TOKENS / (w.working_set_tokens / w.users)
    assert statistics.median(distinct_between(keys)) > users_per_engine
    # a user's later turns wait the gap to its previous round's arrival
    for session in w.measured:
        assert session.turns[0].think_s == 0.0
        assert all(t.think_s > 0 for t in session.turns[1:])


@pytest.mark.parametrize("name", NAMES)
def test_the_warm_up_touches_every_document_or_conversation_once(name):
    w = workload(name, ratio=2.0)
    ids = Counter(s.session_id for s in w.warmup)
    assert set(ids) == {s.session_id for s in w.measured}
    assert set(ids.values()) == {1}
    assert all(len(s.turns) == 1 for s in w.warmup)
    assert all(s.turns[0].max_tokens == WARMUP_MAX_TOKENS for s in w.warmup)
    starts = [s.start_s for s in w.warmup]
    assert starts == sorted(starts)
    warm = {s.session_id: s for s in w.warmup}
    for session in w.measured:
        primed = warm[session.session_id]
        assert primed.system == session.system
        if name == "capacity-docqa":  # the document, then a question of its own
            assert doc_and_question(primed)[0] == doc_and_question(session)[0]
            assert primed.turns[0].user != session.turns[0].user
        else:  # the conversation's first round
            assert primed.turns[0].user == session.turns[0].user


@pytest.mark.parametrize("name", NAMES)
def test_first_touches_are_each_key_s_earliest_request(name):
    w = workload(name, ratio=2.0)
    cold = first_touches(w.measured)
    assert len(cold) == len({s.session_id for s in w.measured})
    assert len({r.key for r in cold}) == len(cold)
    earliest: dict[str, float] = {}
    for request in schedule(w.measured):
        earliest.setdefault(request.key, request.at_s)
    assert all(r.at_s == earliest[r.key] for r in cold)
    if name == "capacity-chat":
        assert {r.turn for r in cold} == {0}
    else:
        assert all(w.measured[r.session].session_id == r.key for r in cold)


@pytest.mark.parametrize("name", NAMES)
def test_the_nonce_opens_every_prompt_so_runs_share_no_prefix(name):
    one, two = workload(name, nonce="run-1"), workload(name, nonce="run-2")
    for w, nonce in ((one, "run-1"), (two, "run-2")):
        assert all(s.system.startswith(f"[{nonce}] ") for s in w.measured + w.warmup)
    assert {s.system for s in one.measured}.isdisjoint({s.system for s in two.measured})


def test_the_builders_take_the_generator_they_are_given():
    kwargs = dict(capacity_tokens=CAPACITY, ratio=1.0, rate_rps=2.0, nonce="n", count_tokens=words)
    assert capacity_docqa(random.Random(1), **kwargs) == capacity_docqa(random.Random(1), **kwargs)
    assert capacity_chat(random.Random(1), **kwargs) != capacity_chat(random.Random(2), **kwargs)


@pytest.mark.parametrize(
    "name, capacity, ratio, rate",
    [
        ("capacity-nope", CAPACITY, 1.0, 1.0),
        ("capacity-docqa", 0, 1.0, 1.0),
        ("capacity-docqa", CAPACITY, 0.0, 1.0),
        ("capacity-chat", CAPACITY, 1.0, -1.0),
    ],
)
def test_invalid_arguments_are_refused(name, capacity, ratio, rate):
    with pytest.raises(InvalidArgument):
        make_capacity_workload(
            name,
            seed=0,
            capacity_tokens=capacity,
            ratio=ratio,
            rate_rps=rate,
            nonce="n",
            count_tokens=words,
        )


@pytest.fixture(scope="module")
def bpe_count():
    """The benchmark model's tokenizer recipe (tiny_model's corpus, vocabulary and
    pre-tokenizer), trained here; counts without special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from quillcache_core.launch.tiny_model import VOCAB_SIZE, corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return functools.cache(lambda text: len(tok.encode(text, add_special_tokens=False).ids))


@pytest.mark.parametrize("name", NAMES)
def test_a_real_byte_level_bpe_counts_hit_their_targets_quickly(name, bpe_count):
    began = time.perf_counter()
    w = workload(name, ratio=4.0, count=bpe_count)
    assert time.perf_counter() - began < 2.0
    assert w.achieved_ratio == pytest.approx(4.0, rel=0.03)
    if name == "capacity-docqa":
        assert w.working_set_tokens == recount_docqa(w, bpe_count)
        pieces = [doc_and_question(s) for s in w.measured]
        assert all(2000 <= bpe_count(document) <= 6000 for document, _ in pieces)
        assert all(64 <= bpe_count(question) <= 256 for _, question in pieces)
    else:
        assert w.working_set_tokens == recount_chat(w, bpe_count)
        messages = [t.user.split("\n\n")[-1] for s in w.measured for t in s.turns]
        assert all(64 <= bpe_count(m) <= 256 for m in messages)
        last = f"conv-{w.users - 1}"  # the user fit to the target
        histories = [s.turns[0].user.split("\n\n")[0] for s in w.measured if s.session_id != last]
        assert all(2000 <= bpe_count(h) <= 4000 for h in histories)
