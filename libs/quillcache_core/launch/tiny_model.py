"""Build a tiny random-weight Llama with its own tokenizer and chat template, offline.

Run with the python of the vLLM environment (it needs torch, transformers, tokenizers):

    python tiny_model.py DIR [--layers N --hidden H --context T]

The default is tiny (2 layers, hidden 128, a context of 2,048 tokens); `--layers 8
--hidden 1024 --context 8192` makes the benchmark model (`vllm_env.ensure_bench_model`),
where a 2,000-token prefill takes seconds on CPU. The context is the model's
max_position_embeddings and its tokenizer's model_max_length.

Deterministic: the tokenizer is trained on a corpus generated from a fixed word list and
a seeded generator, and the weights come from a fixed torch seed, so every machine builds
the same model. About 1.4M parameters; head size 32, one vLLM's CPU attention supports.
This file imports nothing of QuillCache: it runs outside the project's environment.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20261125
VOCAB_SIZE = 4096

WORDS = """
the a an of to in on for with from by at as is are was were be been being have has had
do does did will would can could should may might must shall not no yes and or but if then
else when while where which who whom whose what why how all any each every some many few
more most less least one two three four five six seven eight nine ten hundred thousand
cache block token prefix engine request reply model tenant store node transfer gateway
conductor route plan fetch hit miss evict offload memory disk page queue batch stream
first last next previous time second minute hour day week month year order rocket
delivery customer support question answer document page chapter section paragraph line
word letter number value key name id data byte bytes kilobyte megabyte gigabyte fast slow
high low good bad new old big small long short open close start stop run send receive
read write copy move keep drop hold give take make find help ask tell show know think
please thanks hello goodbye assistant user system tool call function result error ok
""".split()
PUNCTUATION = [".", ",", "?", "!", ":", ";", "-", "(", ")", '"', "'", "/", "#", "*"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% if message.get('tool_calls') %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>' + call['function']['name'] + ' ' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}"
    "{{ '</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ '<|im_start|>tools\\n' + tools | tojson + '<|im_end|>\\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(lines: int = 6000) -> list[str]:
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 24)):
            word = rng.choice(WORDS)
            roll = rng.random()
            if roll < 0.1:
                word = word.capitalize()
            elif roll < 0.15:
                word = str(rng.randint(0, 99999))
            words.append(word)
            if rng.random() < 0.12:
                words.append(rng.choice(PUNCTUATION))
        out.append(" ".join(words))
    return out


def build_tokenizer(context: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=context,
    )


def build(directory: Path, layers: int = 2, hidden: int = 128, context: int = 2048) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(context)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        # head size 32 for the tiny model, 128 from hidden 1024 on: both ones vLLM's CPU
        # attention supports
        num_attention_heads=hidden // (32 if hidden < 1024 else 128),
        num_key_value_heads=hidden // (32 if hidden < 1024 else 128),
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # Written to a temporary name first: a half-built model never looks ready.
    staging = directory.with_name(directory.name + ".building")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    # Some transformers releases write the template to chat_template.jinja only; keep it
    # in tokenizer_config.json too, where every reader looks.
    config_path = staging / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tok_config, indent=2))
    for item in staging.iterdir():
        item.replace(directory / item.name)
    staging.rmdir()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="tiny_model.py", description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument(
        "--context", type=int, default=2048, help="max_position_embeddings, in tokens"
    )
    args = parser.parse_args()
    build(Path(args.dir), args.layers, args.hidden, args.context)
    print(f"model in {args.dir}")
