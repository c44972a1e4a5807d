#!/usr/bin/env python3
"""Soak test of `ingot serve`: mixed traffic from concurrent clients for a while, then a
report of what was served, the errors by status, the server's memory and the KV blocks
left in use.

    bench/soak.py [--minutes 10] [--clients 8] [--model PATH] [--port 8011]
                  [--kv-cache-memory BYTES] [-- SERVE_ARGS...]

It starts `target/release/ingot serve` on the model (default: the test model from
scripts/fetch-test-model) and drives it with a mix of plain, streamed, multi-sample,
disconnecting (mid-stream and before a non-streamed answer) and invalid requests. RSS is
read from /proc at start (model loaded), after the warm-up (the first fifth of the run)
and at the end, each time with the clients paused and the server idle, so that requests
in flight do not count; growth after the warm-up must stay under 1 %, and no block may be
in use once the clients stop. Exit status 1 when either fails. Standard library only.

The KV cache is committed when the server starts, so growth after the warm-up measures
what the process keeps of its traffic: leaks, caches that grow, memory the allocator holds.
"""

import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the harbour town grew quickly as fishing fleets merchants and travellers arrived "
         "from every direction while the old lighthouse keeper wrote in his journal").split()


def prompt(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def metric(port, name):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{name} missing from /metrics")


class Client(threading.Thread):
    """One client: picks a request kind at random, sends it, records the outcome."""

    def __init__(self, port, seed, stop, paused, idle, tally, lock):
        super().__init__(daemon=True)
        self.port, self.rng, self.stop, self.tally, self.lock = port, random.Random(seed), stop, tally, lock
        self.paused, self.idle = paused, idle

    def record(self, kind, outcome):
        with self.lock:
            self.tally[(kind, outcome)] += 1

    def post(self, path, body, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def run(self):
        kinds = [
            ("completion", 4), ("chat", 3), ("stream", 3), ("n4", 1),
            ("disconnect_stream", 2), ("disconnect_wait", 1), ("invalid", 2),
        ]
        names = [k for k, _ in kinds]
        weights = [w for _, w in kinds]
        while not self.stop.is_set():
            if self.paused.is_set():
                self.idle.set()
                time.sleep(0.05)
                continue
            self.idle.clear()
            kind = self.rng.choices(names, weights)[0]
            try:
                self.record(kind, getattr(self, kind)())
            except (OSError, http.client.HTTPException) as e:
                self.record(kind, f"client error {type(e).__name__}")

    def completion(self):
        body = {"prompt": prompt(self.rng, self.rng.randint(1, 200)),
                "max_tokens": self.rng.randint(1, 64), "temperature": self.rng.choice([0, 0.8])}
        conn, r = self.post("/v1/completions", body)
        r.read()
        conn.close()
        return r.status

    def chat(self):
        body = {"messages": [{"role": "user", "content": prompt(self.rng, 20)}],
                "max_tokens": self.rng.randint(1, 64), "top_p": 0.9, "seed": self.rng.randint(0, 99)}
        conn, r = self.post("/v1/chat/completions", body)
        r.read()
        conn.close()
        return r.status

    def stream(self):
        body = {"prompt": prompt(self.rng, 30), "max_tokens": 48, "stream": True,
                "stream_options": {"include_usage": True}}
        conn, r = self.post("/v1/completions", body)
        text = r.read().decode()
        conn.close()
        if r.status == 200 and not text.rstrip().endswith("data: [DONE]"):
            return "stream without [DONE]"
        return r.status

    def n4(self):
        body = {"prompt": prompt(self.rng, 40), "max_tokens": 32, "n": 4, "temperature": 1.0}
        conn, r = self.post("/v1/completions", body)
        r.read()
        conn.close()
        return r.status

    def disconnect_stream(self):
        body = {"prompt": prompt(self.rng, 60), "max_tokens": 256, "ignore_eos": True,
                "n": self.rng.choice([1, 8]), "stream": True}
        conn, r = self.post("/v1/completions", body)
        status = r.status
        if status == 200:
            r.read1(64)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        return f"{status} then left"

    def disconnect_wait(self):
        body = {"prompt": prompt(self.rng, 60), "max_tokens": 256, "ignore_eos": True, "n": 4}
        try:
            conn, r = self.post("/v1/completions", body, timeout=0.2)
            r.read()
            conn.close()
            return f"{r.status} before leaving"
        except socket.timeout:
            return "left before the answer"

    def invalid(self):
        body = self.rng.choice([
            b"{not json",
            {"prompt": "hi", "n": 100000},
            {"prompt": "hi", "temperature": -1},
            {"prompt": "hi", "max_tokens": 10 ** 9},
            {"prompt": "hi", "model": "no-such-model"},
            {"prompt": "hi", "stop": ["x"] * 100},
            {"prompt": [[1, 2, 10 ** 9]]},
            {"prompt": "word " * 50000},
        ])
        conn, r = self.post("/v1/completions", body)
        r.read()
        conn.close()
        return r.status


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ingot"))
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    model = args.model or subprocess.check_output([os.path.join(ROOT, "scripts/fetch-test-model")], text=True).strip()
    cmd = [args.binary, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(args.port),
           "--max-model-len", "2048", "--kv-cache-memory", str(args.kv_cache_memory)] + args.serve_args
    print("server:", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                sys.exit("the server did not start")
            time.sleep(0.2)
        rss_start = rss_kib(server.pid)
        stop, lock, tally = threading.Event(), threading.Lock(), collections.Counter()
        paused = threading.Event()
        clients = [Client(args.port, seed, stop, paused, threading.Event(), tally, lock)
                   for seed in range(args.clients)]
        for c in clients:
            c.start()
        total = args.minutes * 60
        started = time.time()
        time.sleep(total / 5)
        paused.set()
        for c in clients:
            c.idle.wait()
        time.sleep(2)
        rss_warm = rss_kib(server.pid)
        paused.clear()
        while (left := total - (time.time() - started)) > 0:
            time.sleep(min(30, left))
            print(f"  {time.time() - started:6.0f} s: {sum(tally.values())} requests, "
                  f"RSS {rss_kib(server.pid) / 1024:.1f} MiB", flush=True)
        stop.set()
        for c in clients:
            c.join(timeout=180)
        time.sleep(2)
        rss_end = rss_kib(server.pid)
        blocks = metric(args.port, "ingot:kv_cache_blocks_in_use")
        seqs = metric(args.port, "ingot:num_sequences_waiting") + metric(args.port, "ingot:num_sequences_running")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = "killed after 60 s"

    print(f"\n{args.clients} clients for {args.minutes:g} min: {sum(tally.values())} requests")
    by_kind = collections.defaultdict(list)
    for (kind, outcome), count in sorted(tally.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        by_kind[kind].append(f"{outcome}: {count}")
    for kind, outcomes in by_kind.items():
        print(f"  {kind:18} {', '.join(outcomes)}")
    statuses = collections.Counter()
    for (kind, outcome), count in tally.items():
        statuses[str(outcome).split()[0]] += count
    print("  by status:", ", ".join(f"{s}: {c}" for s, c in sorted(statuses.items())))
    growth = (rss_end - rss_warm) / rss_warm * 100
    print(f"RSS: start {rss_start / 1024:.1f} MiB, after warm-up {rss_warm / 1024:.1f} MiB, "
          f"end {rss_end / 1024:.1f} MiB (growth after warm-up {growth:+.2f} %)")
    print(f"at the end: {blocks:.0f} KV blocks in use, {seqs:.0f} sequences left; server exit {code}")
    ok = growth < 1.0 and blocks == 0 and seqs == 0 and code == 0
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
