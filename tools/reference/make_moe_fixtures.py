#!/usr/bin/env python3
"""Writes the HF transformers reference for the mixture-of-experts models' tests.

Needs torch and transformers in the running Python (see tools/reference/README.md). Loads a
tiny random Qwen3-MoE or Mixtral model that `cargo run -p ingot-model --example synthetic --
ARCH DIR` writes, in fp32 on the CPU, and for a few prompts of random token ids records the
greedy continuation, step by step, with the margin between the two largest logits of each
step (random routers and weights make near-ties: a test compares tokens only up to the
first step whose margin is below its threshold).

usage: make_moe_fixtures.py MODEL_DIR OUT_JSON
"""
import hashlib
import json
import random
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

STEPS = 24
PROMPT_LENGTHS = [1, 5, 17, 40]


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(11)
    cases = []
    with torch.no_grad():
        for n in PROMPT_LENGTHS:
            prompt = [rng.randrange(vocab) for _ in range(n)]
            ids = list(prompt)
            greedy, margins = [], []
            for _ in range(STEPS):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2)
                greedy.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                ids.append(greedy[-1])
            cases.append({"prompt": prompt, "greedy": greedy, "margins": margins})
    with open(f"{model_dir}/model.safetensors", "rb") as f:
        weights_sha256 = hashlib.sha256(f.read()).hexdigest()
    fixture = {
        "meta": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "model_type": model.config.model_type,
            "weights_sha256": weights_sha256,
        },
        "cases": cases,
    }
    with open(out, "w") as f:
        json.dump(fixture, f)


if __name__ == "__main__":
    main()
