"""A long prompt piece reuses the ids of a kept piece it opens like (`_PieceCache`), and
its ids are always those of a whole pass, on the pre-tokenizers of real models."""

import random

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from quillcache_core.identity.tokenize import PIECE_CHECK_EVERY, ModelTokenizer, TokenMemo
from tests.support.chatml import chatml_model_dir

pytestmark = pytest.mark.unit

# Llama 3's pre-tokenizer pattern (its tokenizer.json's Split), GPT-2's is ByteLevel's own.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PIECES = (
    "cache", "Tenant", "block", "the", "plans", "x", "42", "2026", "1234567", "3.14",
    ",", ".", "'s", "'ll", "!?", "--", "(a)", "_id", "é", "naïve", "中文", "🙂", "\t",
    "\n", "\n\n", "  ", "   ", "e\u0301",
)  # fmt: skip


def _text(rng: random.Random, words: int) -> str:
    out = []
    for _ in range(words):
        out.append(rng.choice(PIECES))
        out.append(" " if rng.random() < 0.8 else rng.choice(["", "  ", "\n", " \n "]))
    return "".join(out)


def _model_dir(tmp_path, pre_tokenizer, model="bpe"):
    """A model directory with a tokenizer trained here on `_text`'s pieces."""
    rng = random.Random(7)
    corpus = [_text(rng, 60) for _ in range(300)]
    if model == "bpe":
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(
            vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]"])
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(corpus, trainer)
    return chatml_model_dir(tmp_path, tok)


TOKENIZERS = {
    "gpt2-bytelevel": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "bytelevel-prefix-space": lambda: pre_tokenizers.ByteLevel(add_prefix_space=True),
    "llama3-split": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
    "bert-wordpiece": lambda: pre_tokenizers.BertPreTokenizer(),
}


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_reused_ids_are_a_whole_pass_s_wherever_prompts_part(tmp_path, kind):
    """Documents asked about with other questions, conversations that grow, and openings
    cut anywhere (in a word, a run of spaces, a multi-byte character) then continued
    otherwise: every prompt's ids equal a whole pass's, and most of the long ones' text
    was reused."""
    model_kind = "wordpiece" if kind == "bert-wordpiece" else "bpe"
    directory = _model_dir(tmp_path, TOKENIZERS[kind](), model_kind)
    model = ModelTokenizer(directory)
    whole = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = random.Random(kind)
    docs = [_text(rng, rng.randint(150, 400)) for _ in range(4)]
    texts = []
    for _ in range(120):
        doc = rng.choice(docs)
        roll = rng.random()
        if roll < 0.4:  # the document again, another question
            user = f"Document:\n{doc}\n\nQuestion: {_text(rng, rng.randint(1, 12))}?"
        elif roll < 0.7:  # an opening cut anywhere, then something else
            user = doc[: rng.randrange(len(doc))] + _text(rng, rng.randint(1, 30))
        else:  # the document grown
            user = doc + _text(rng, rng.randint(1, 40))
            docs.append(user)
        texts.append(
            f"<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        )
    scoped = model.scoped(TokenMemo())
    for text in texts:
        assert scoped.encode(text) == whole.encode(text, add_special_tokens=False).ids
        scoped.commit()
    counts = model.piece_counts
    assert counts["mismatches"] == 0 and counts["checks"] == len(texts) // PIECE_CHECK_EVERY
    long_chars = sum(len(t) for t in texts if len(t) > 600)
    assert counts["reused_chars"] > 0.5 * long_chars, counts


def test_a_question_on_a_kept_document_tokenizes_only_what_follows_it(tmp_path):
    directory = _model_dir(tmp_path, TOKENIZERS["gpt2-bytelevel"]())
    model = ModelTokenizer(directory)
    whole = Tokenizer.from_file(str(directory / "tokenizer.json"))
    doc = _text(random.Random(3), 300)
    acme = model.scoped(TokenMemo())

    def ask(question: str) -> str:
        return f"<|im_start|>user\nDocument:\n{doc}\n\nQuestion: {question}?<|im_end|>\n"

    acme.encode(ask("who plans the cache"))
    acme.commit()
    before = model.piece_counts["reused_chars"]
    text = ask("what does the store keep")
    assert acme.encode(text) == whole.encode(text).ids
    reused = model.piece_counts["reused_chars"] - before
    assert len(doc) <= reused < len(text)  # the document and more, not the new question


def test_one_tenant_never_reuses_another_s_pieces(tmp_path):
    directory = _model_dir(tmp_path, TOKENIZERS["gpt2-bytelevel"]())
    model = ModelTokenizer(directory)
    text = f"<|im_start|>user\n{_text(random.Random(4), 300)}<|im_end|>\n"
    acme, globex = TokenMemo(), TokenMemo()
    view = model.scoped(acme)
    first = view.encode(text)
    view.commit()
    counts = dict(model.piece_counts)
    assert model.scoped(globex).encode(text) == first
    assert model.piece_counts["misses"] == counts["misses"] + 1
    assert model.piece_counts["reused_chars"] == counts["reused_chars"]
    model.scoped(acme).encode(text)
    assert model.piece_counts["hits"] == counts["hits"] + 1
