#!/usr/bin/env python3
"""Writes the HF transformers reference fixtures ingot's tests compare against.

Needs torch, transformers, gguf and accelerate in the running Python (it installs
nothing); see tools/reference/README.md. Loads the GGUF test model in fp32 on the CPU,
the way transformers dequantizes it, and writes small JSON files:

  logits.json     per prompt: prompt ids, 32 greedy ids, top-5 (id, logit) per step
  tokenizer.json  token ids transformers' tokenizer gives for varied strings
  chat.json       chat-template renderings of a few conversations

usage: make_fixtures.py GGUF_PATH OUT_DIR
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

STEPS = 32
TOP = 5

FOX = "The quick brown fox jumps over the lazy dog. "

LONG_TEXT = (
    "In the beginning of the twentieth century, the small harbour town grew quickly as "
    "fishing fleets, merchants and travellers arrived from every direction. The old "
    "lighthouse keeper kept a journal of every ship that passed, noting the weather, the "
    "cargo and the names of the captains. Years later, historians found the journals in "
    "an attic and used them to reconstruct the economic life of the coast, from the price "
    "of salt to the seasons of the herring. "
)

CODE = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


if __name__ == "__main__":
    for i in range(10):
        print(i, fibonacci(i))
'''

TOKENIZER_STRINGS = [
    "Hello, world!",
    "",
    " ",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Numbers: 1234567890 and 3.14159 and -42",
    "The year 2024 had 366 days.",
    "émigré café naïve résumé",
    "Größenwahn und Übermut",
    "日本語のテキストです。",
    "中文测试：你好，世界！",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "हिन्दी भाषा",
    "emoji: 😀🎉👍🏽 and 🇫🇷 flags",
    "👨‍👩‍👧‍👦 family",
    "def f(x):\n    return x ** 2  # square",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "<html><body class=\"x\">text</body></html>",
    "SELECT * FROM users WHERE id = 7;",
    "    four spaces then text",
    "a      b       c",
    "don't won't can't I'm you're we've they'll she'd",
    "ALL CAPS SENTENCE HERE",
    "mIxEd CaSe WoRdS",
    "hyphen-ated words and under_scores and camelCaseWords",
    "https://example.com/path?query=1&other=two#frag",
    "email@example.org",
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more",
    "1+1=2, 2*3=6, 10/4=2.5",
    "$100.00 €50 £30 ¥1000",
    "...!!!???---___",
    "\u00a0non-breaking\u00a0space",
    "zero\u200bwidth",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats."},
    ],
]


def prompts(tok):
    long_ids = tok.encode(LONG_TEXT * 20, add_special_tokens=False)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    cases = [
        ("single_token", long_ids[:1]),
        ("len15", long_ids[:15]),
        ("len16", long_ids[:16]),
        ("len17", long_ids[:17]),
        ("len255", long_ids[:255]),
        ("len256", long_ids[:256]),
        ("len257", long_ids[:257]),
        ("code", tok.encode(CODE, add_special_tokens=False)),
        ("french", tok.encode("La tour Eiffel est située à Paris. Elle a été construite", add_special_tokens=False)),
        ("chinese", tok.encode("北京是中国的首都，也是一座历史悠久的城市。", add_special_tokens=False)),
        ("fox_x50", tok.encode(FOX * 50, add_special_tokens=False)),
        ("chat_haiku", tok.encode(chat, add_special_tokens=False)),
        ("long_1500", long_ids[:1500]),
    ]
    assert len(long_ids) >= 1500, len(long_ids)
    return cases


@torch.no_grad()
def greedy(model, ids):
    out = model(torch.tensor([ids]), use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    tokens, tops = [], []
    for _ in range(STEPS):
        vals, idx = torch.topk(logits, TOP)
        tops.append([[int(i), float(v)] for i, v in zip(idx, vals)])
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, tops


def main():
    gguf_path, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    d, f = os.path.split(os.path.abspath(gguf_path))
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()

    cases = []
    for name, ids in prompts(tok):
        tokens, tops = greedy(model, ids)
        cases.append({"name": name, "prompt_ids": ids, "greedy_ids": tokens, "top5": tops})
        print(f"{name}: {len(ids)} prompt tokens -> {tok.decode(tokens)!r}", flush=True)
    meta = {"model": f, "transformers": __import__("transformers").__version__, "torch": torch.__version__}
    with open(os.path.join(out_dir, "logits.json"), "w") as fh:
        json.dump({"meta": meta, "steps": STEPS, "cases": cases}, fh)

    toks = [{"text": s, "ids": tok.encode(s, add_special_tokens=True)} for s in TOKENIZER_STRINGS]
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as fh:
        json.dump({"meta": meta, "cases": toks}, fh, ensure_ascii=False, indent=0)

    chats = [
        {"messages": m, "rendered": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)}
        for m in CONVERSATIONS
    ]
    with open(os.path.join(out_dir, "chat.json"), "w") as fh:
        json.dump({"meta": meta, "cases": chats}, fh, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
