"""The sim engine's side of a split answer's continuation: its output is a prefix of one
sequence per prompt (a one-token prefill samples a whole answer's first token), and a
continuation (the plan's `continues`) streams the rest of that sequence."""

from __future__ import annotations

import pytest

from quillcache_core.identity.tokenize import BuiltinTokenizer
from quillcache_simengine.completions import _output
from quillcache_simengine.openai_api import ApiError, parse_request
from quillcache_simengine.output import generate

pytestmark = pytest.mark.unit

PLAN = {
    "reservation_id": "r",
    "engine_id": "e",
    "model_id": "m",
    "tokenizer_id": "t",
    "tenant_id": "acme",
}
PROMPT = list(range(100, 140))


def parse(body: dict, *, default_max_tokens: int = 16):
    return parse_request(
        {"model": "sim-model", **body},
        chat=False,
        served_model="sim-model",
        tokenizer=BuiltinTokenizer(),
        default_max_tokens=default_max_tokens,
        max_model_len=4096,
    )


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 300])
def test_a_shorter_answer_is_the_longer_ones_beginning(n):
    assert generate(PROMPT, n) == generate(PROMPT, 400)[:n]


@pytest.mark.parametrize(("done", "more"), [(1, 1), (1, 47), (3, 30)])
def test_a_continuation_streams_the_rest_of_the_whole_requests_output(done, more):
    whole = generate(PROMPT, done + more)
    first_ids = BuiltinTokenizer().encode("".join(whole[:done]))
    tokens = tuple(PROMPT + first_ids)
    assert _output(tokens, more, (len(PROMPT), done)) == whole[done:]
    assert _output(tokens, more, None) == generate(tokens, more)  # not a continuation


def test_the_plans_continues_is_read_and_checked():
    body = {"prompt": PROMPT + [7], "max_tokens": 5}
    plan = {**PLAN, "continues": {"prompt_tokens": 40, "output_tokens": 1}}
    parsed = parse({**body, "kv_transfer_params": {"quillcache": plan}})
    assert parsed.continues == (40, 1) and parsed.max_tokens == 5
    assert parse(body).continues is None
    # the engine's default budget counts the output tokens continued from
    parsed = parse({"prompt": PROMPT + [7], "kv_transfer_params": {"quillcache": plan}})
    assert parsed.max_tokens == 15


@pytest.mark.parametrize(
    "continues",
    [
        "yes",
        {"prompt_tokens": 41, "output_tokens": 1},  # no output token left in the prompt
        {"prompt_tokens": 0, "output_tokens": 1},
        {"prompt_tokens": 40, "output_tokens": True},
        {"prompt_tokens": 40},
    ],
)
def test_a_malformed_continues_is_a_400(continues):
    body = {
        "prompt": PROMPT + [7],
        "kv_transfer_params": {"quillcache": {**PLAN, "continues": continues}},
    }
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == 400 and err.value.param == "kv_transfer_params"
    assert "continues" in err.value.message


def test_return_token_ids_is_a_boolean():
    assert parse({"prompt": "hi", "return_token_ids": True}).return_token_ids
    assert not parse({"prompt": "hi"}).return_token_ids
    with pytest.raises(ApiError):
        parse({"prompt": "hi", "return_token_ids": "yes"})
