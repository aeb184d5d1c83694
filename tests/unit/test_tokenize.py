import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.tokenize import (
    BuiltinTokenizer,
    load_tokenizers,
    prompt_tokens,
    render_chat,
)
from tests.support.chatml import chatml_model_dir

pytestmark = pytest.mark.unit

TEXT = (
    "QuillCache routes requests to the engine that holds their prefix. "
    "Tenants never share cached blocks. The conductor plans, the store keeps bytes. "
) * 20


def train_tokenizer(path) -> str:
    """A small byte-level BPE tokenizer trained here, saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))
    return str(path)


def test_chat_renders_the_whole_conversation_with_the_assistant_prefix():
    text = render_chat(
        [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi "},
                    {"type": "image_url", "image_url": {}},
                    {"type": "text", "text": "there"},
                ],
            },
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ]
    )
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [3],
        [{"role": "user", "content": [{"text": "no type"}]}],
    ],
)
def test_malformed_chat_is_rejected(messages):
    with pytest.raises(InvalidArgument):
        render_chat(messages)


def test_prompt_forms():
    tok = BuiltinTokenizer()
    assert prompt_tokens("a b", tok) == [tok.encode("a b")]
    assert prompt_tokens(["a", "b c"], tok) == [tok.encode("a"), tok.encode("b c")]
    assert prompt_tokens([5, 6, 7], tok) == [[5, 6, 7]]
    assert prompt_tokens([[1], [2, 3]], tok) == [[1], [2, 3]]
    for bad in ([], [1, "a"], [-1], [True], 3, None, [[]]):
        with pytest.raises(InvalidArgument):
            prompt_tokens(bad, tok)


def test_builtin_tokenizer_is_deterministic_and_splits_words():
    tok = BuiltinTokenizer()
    assert tok.encode("Hello, world") == tok.encode("Hello, world")
    assert len(tok.encode("Hello, world")) == 4  # Hello , space world
    assert all(0 <= t < 32000 for t in tok.encode(TEXT))


def test_a_locally_trained_tokenizer_json_is_used_per_model(tmp_path):
    path = train_tokenizer(tmp_path / "tok.json")
    tokenizers = load_tokenizers(f"my-model={path}")
    tok = tokenizers["my-model"]
    ids = tok.encode("The conductor plans.")
    assert ids == tok.encode("The conductor plans.")
    assert ids != BuiltinTokenizer().encode("The conductor plans.")
    assert len(ids) < len("The conductor plans."), "BPE merges learned from the text"
    assert tok.name == "my-model:tok.json"


def test_bad_tokenizer_specs_are_rejected(tmp_path):
    with pytest.raises(InvalidArgument):
        load_tokenizers("no-equals-sign")
    with pytest.raises(InvalidArgument):
        load_tokenizers(f"m={tmp_path / 'missing.json'}")


def test_a_model_directory_refuses_untokenizable_text_with_a_client_error(tmp_path):
    import json

    from quillcache_core.identity.tokenize import ModelTokenizer, request_tokens

    train_tokenizer(tmp_path / "tokenizer.json")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = ModelTokenizer(tmp_path)
    assert request_tokens("completion", {"prompt": "fine text"}, tok)
    chat = {"messages": [{"role": "user", "content": "fine"}]}
    assert request_tokens("chat", chat, tok) == tok.encode("user: fine\n")
    for payload, kind in (
        ({"prompt": "a lone \ud800 surrogate"}, "completion"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "chat"),
    ):
        with pytest.raises(InvalidArgument, match="cannot be tokenized"):
            request_tokens(kind, payload, tok)


def chat_model_dir(tmp_path, **added):
    """A model directory: the tokenizer trained here with ChatML's added tokens (their
    options from `added`) and a ChatML template."""
    tok = Tokenizer.from_file(train_tokenizer(tmp_path / "tokenizer.json"))
    return chatml_model_dir(tmp_path, tok, **added)


def rendered(model, chat: dict) -> str:
    return model.template.render(
        chat["messages"],
        tools=None,
        documents=None,
        add_generation_prompt=True,
        continue_final_message=False,
        template_kwargs=None,
    )


def test_a_chat_s_long_pieces_keep_their_ids_within_a_tenant(tmp_path):
    from quillcache_core.identity.tokenize import ModelTokenizer, TokenMemo, request_tokens

    model = ModelTokenizer(chat_model_dir(tmp_path))
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    document = TEXT[:1500]
    acme, globex = model.scoped(TokenMemo()), model.scoped(TokenMemo())

    def chat(question: str) -> dict:
        return {
            "messages": [
                {"role": "system", "content": document},
                {"role": "user", "content": question},
            ]
        }

    for n, question in enumerate(["Who plans?", "What do stores keep?", "Tenants?"]):
        ids = request_tokens("chat", chat(question), acme)
        acme.commit()
        assert ids == whole.encode(rendered(model, chat(question))).ids
        assert model.piece_counts["hits"] == n  # the document's ids, from the 2nd question on
    request_tokens("chat", chat("Who plans?"), globex)  # another tenant: tokenized anew
    assert model.piece_counts["hits"] == 2 and model.piece_counts["misses"] == 2


def test_piece_ids_are_not_reused_where_an_added_token_strips_its_neighbours(tmp_path):
    """An added token that eats the whitespace beside it joins its pieces' fates: such a
    tokenizer is always tokenized whole."""
    from quillcache_core.identity.tokenize import ModelTokenizer, TokenMemo, request_tokens

    model = ModelTokenizer(chat_model_dir(tmp_path, lstrip=True))
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    chat = {"messages": [{"role": "system", "content": TEXT[:1500] + "  "}]}
    ids = request_tokens("chat", chat, model.scoped(TokenMemo()))
    assert ids == whole.encode(rendered(model, chat)).ids
    assert model.piece_counts == {}


def test_a_piece_cache_that_disagrees_with_a_whole_pass_turns_itself_off(tmp_path):
    from quillcache_core.identity import tokenize

    model = tokenize.ModelTokenizer(chat_model_dir(tmp_path))
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = f"<|im_start|>system\n{TEXT[:1500]}<|im_end|>\n"
    model.encode(text)
    for entry in model._memo.texts._entries.values():  # a wrong entry
        ids = entry[3][0]
        ids[:] = [7] * len(ids)
    seen = [model.encode(text) for _ in range(tokenize.PIECE_CHECK_EVERY)]
    assert seen[-1] == whole.encode(text).ids  # the checked text: the whole pass's ids
    assert model.piece_counts["mismatches"] == 1 and not model._pieces.on
    assert model.encode(text) == whole.encode(text).ids  # from then on, whole passes
