#!/usr/bin/env python3
"""Writes the HF transformers reference for ingot's embeddings test.

Needs torch and transformers in the running Python (see tools/reference/README.md). Loads
the tiny random Qwen3 model that `cargo run -p ingot-model --example synthetic -- qwen3 DIR`
writes, runs each input alone in fp32 on the CPU, and pools transformers'
`last_hidden_state` three ways, L2-normalized as sentence-transformers' Normalize module
does:

  last   the last token's row (Qwen3-Embedding's pooling)
  mean   the mean of every row
  cls    the first row

usage: make_embedding_fixtures.py MODEL_DIR OUT_JSON
"""
import hashlib
import json
import random
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModel

# One token to past the 300-token mark, and lengths around the KV block size of 16.
LENGTHS = [1, 2, 7, 15, 16, 17, 33, 64, 129, 300, 333]


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(7)
    inputs = [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]
    pooled = {"last": [], "mean": [], "cls": []}
    with torch.no_grad():
        for ids in inputs:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            for name, row in (("last", h[-1]), ("mean", h.mean(0)), ("cls", h[0])):
                pooled[name].append(F.normalize(row, dim=0).tolist())
    with open(f"{model_dir}/model.safetensors", "rb") as f:
        weights_sha256 = hashlib.sha256(f.read()).hexdigest()
    fixture = {
        "meta": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "model": "SyntheticSpec::tiny(Arch::Qwen3)",
            "weights_sha256": weights_sha256,
        },
        "inputs": inputs,
        "pooled": pooled,
    }
    with open(out, "w") as f:
        json.dump(fixture, f)


if __name__ == "__main__":
    main()
