#!/usr/bin/env python3
"""Writes a GGUF that holds only another GGUF's metadata (its tokenizer and chat template)
and no tensors: a few MB that carry to the GPU machine, where `ingot serve --tokenizer` and
`ingot bench serve --tokenizer` read it beside dummy weights.

    scripts/gpu/tokenizer-gguf.py MODEL.gguf OUT.gguf
"""
import struct
import sys

# Sizes of GGUF's fixed-size value types, by type id.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


def skip_value(buf, pos, kind):
    if kind in FIXED:
        return pos + FIXED[kind]
    if kind == STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in FIXED:
            return pos + count * FIXED[item]
        for _ in range(count):
            pos = skip_value(buf, pos, item)
        return pos
    raise ValueError(f"unknown GGUF value type {kind}")


def main(src, dst):
    buf = open(src, "rb").read()
    magic, version, _tensors, kvs = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version < 2:
        sys.exit(f"{src}: not a GGUF v2/v3 file")
    pos = 24
    for _ in range(kvs):
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos = skip_value(buf, pos + 4, kind)
    with open(dst, "wb") as f:
        f.write(struct.pack("<4sIQQ", magic, version, 0, kvs))
        f.write(buf[24:pos])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
