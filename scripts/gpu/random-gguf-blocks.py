"""Writes a GGUF of random Llama-shaped weights in a GGUF block format, without a tokenizer
(as ../shared/tools/llamacpp-cuda-peer/random_gguf.py writes f16 ones), for speed runs of
the CUDA backend's block kernels without llama.cpp's build: the matrices are random values
of about 0.02 quantized by gguf-py (Q4_0, Q4_1, Q8_0), or random K-quant blocks with a
small d (Q4_K, Q5_K, Q6_K, which gguf-py cannot quantize); the output projection stays f16.
Usage: random-gguf-blocks.py OUT.gguf Q4_0|Q4_1|Q8_0|Q4_K|Q5_K|Q6_K [8b|tiny]
One random matrix per shape is reused across layers. Needs numpy and gguf-py."""
import sys
import numpy as np
import gguf
from gguf.quants import quantize

path, kind = sys.argv[1], sys.argv[2]
size = sys.argv[3] if len(sys.argv) > 3 else "8b"
qtype = gguf.GGMLQuantizationType[kind]
rng = np.random.default_rng(0)


def r(*shape):
    return rng.standard_normal(shape, dtype=np.float32) * 0.02


# Where a K-quant block keeps its f16 scales (d, and Q4_K's dmin), and its size.
K_SCALES = {"Q4_K": ([0, 2], 144), "Q5_K": ([0, 2], 176), "Q6_K": ([208], 210)}


def q(rows, cols):
    if kind not in K_SCALES:
        return quantize(r(rows, cols), qtype)
    at, size = K_SCALES[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(1e-4).tobytes(), dtype=np.uint8)
    for a in at:
        blocks[:, :, a:a + 2] = d
    return blocks.reshape(rows, -1)


if size == "8b":
    H, I, L, NH, KV, V, theta = 4096, 14336, 32, 32, 8, 128256, 500000.0
else:  # a few layers of small shapes, to check the file loads
    H, I, L, NH, KV, V, theta = 256, 512, 2, 4, 2, 49152, 10000.0
D = H // NH
w = gguf.GGUFWriter(path, "llama")
w.add_name(f"random-llama-{size}-{kind}")
w.add_context_length(8192); w.add_embedding_length(H); w.add_block_count(L)
w.add_feed_forward_length(I); w.add_head_count(NH); w.add_head_count_kv(KV)
w.add_rope_dimension_count(D); w.add_rope_freq_base(theta); w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(V); w.add_tokenizer_model("none")
ones = np.ones(H, dtype=np.float32)
wq, wkv, wo, gate, down = q(NH * D, H), q(KV * D, H), q(H, NH * D), q(I, H), q(H, I)
w.add_tensor("token_embd.weight", q(V, H), raw_dtype=qtype)
for l in range(L):
    p = f"blk.{l}."
    w.add_tensor(p + "attn_norm.weight", ones); w.add_tensor(p + "ffn_norm.weight", ones)
    w.add_tensor(p + "attn_q.weight", wq, raw_dtype=qtype)
    w.add_tensor(p + "attn_k.weight", wkv, raw_dtype=qtype)
    w.add_tensor(p + "attn_v.weight", wkv, raw_dtype=qtype)
    w.add_tensor(p + "attn_output.weight", wo, raw_dtype=qtype)
    w.add_tensor(p + "ffn_gate.weight", gate, raw_dtype=qtype)
    w.add_tensor(p + "ffn_up.weight", gate, raw_dtype=qtype)
    w.add_tensor(p + "ffn_down.weight", down, raw_dtype=qtype)
w.add_tensor("output_norm.weight", ones); w.add_tensor("output.weight", r(V, H).astype(np.float16))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", path)
