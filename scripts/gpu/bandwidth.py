#!/usr/bin/env python3
"""Device memory bandwidth of this GPU, the roofline's denominator, measured with PyTorch.

Prints one JSON line: read-only bandwidth (a sum over a 4 GiB tensor, which reads every
byte once and writes nothing) and copy bandwidth (bytes read plus bytes written, over a
copy of 2 GiB), each the median of 20 timed runs after 3 warm-up runs, in bytes per second.
Decode reads weights and KV and writes little, so the read figure is the roofline's; the
copy figure is printed beside it because earlier reports quoted a copy.
"""
import json
import statistics

import torch


def timed(fn, runs=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    device = torch.device("cuda")
    read = torch.ones(2 << 30, dtype=torch.bfloat16, device=device)
    read_s = timed(lambda: read.sum(dtype=torch.float32))
    read_bytes = read.numel() * read.element_size()
    del read
    src = torch.ones(1 << 30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    copy_bytes = 2 * src.numel() * src.element_size()
    print(json.dumps({
        "device": torch.cuda.get_device_name(device),
        "read_bytes_per_s": read_bytes / read_s,
        "copy_bytes_per_s": copy_bytes / copy_s,
    }))


if __name__ == "__main__":
    main()
