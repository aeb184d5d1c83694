"""A model directory around a tokenizer trained in a test: ChatML's added tokens and a
ChatML chat template, as `ModelTokenizer` reads one."""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


def chatml_model_dir(directory: Path, tok: Tokenizer, **added) -> Path:
    """Save `tok` with `<|im_start|>` and `<|im_end|>` added (their options from `added`)
    and a ChatML template into `directory`."""
    tok.add_special_tokens([AddedToken(t, **added) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    return directory
