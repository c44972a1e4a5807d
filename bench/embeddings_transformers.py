#!/usr/bin/env python3
"""The transformers peer of `ingot bench embed`: a model built from a config directory
(random weights, bf16, CUDA), batches of random token ids of one length, last-token pooling
and L2 normalization as Qwen3-Embedding's sentence-transformers modules do. Eager PyTorch,
with SDPA attention; all inputs of a batch have the same length, so there is no padding.

usage: embeddings_transformers.py CONFIG_DIR INPUT_LEN NUM_INPUTS BATCH [ITERS]
Prints one JSON line: inputs/s and tokens/s (median over ITERS, default 3, after a warm-up).
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel


def main():
    config_dir, input_len, num_inputs, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    iters = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    ids = torch.randint(0, config.vocab_size, (num_inputs, input_len), device="cuda")

    def run():
        out = []
        with torch.no_grad():
            for i in range(0, num_inputs, batch):
                h = model(input_ids=ids[i:i + batch]).last_hidden_state
                out.append(F.normalize(h[:, -1].float(), dim=-1))
        torch.cuda.synchronize()
        return out

    run()
    rates = []
    for _ in range(iters):
        t = time.perf_counter()
        run()
        rates.append(num_inputs / (time.perf_counter() - t))
    r = statistics.median(rates)
    print(json.dumps({"peer": "transformers", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                      "input_len": input_len, "num_inputs": num_inputs, "batch": batch,
                      "inputs_per_s": r, "tokens_per_s": r * input_len}))


if __name__ == "__main__":
    main()
