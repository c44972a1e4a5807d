"""Starts `ingot serve` on the real test model for the API tests.

INGOT_BIN names the binary (default target/debug/ingot, built by `cargo test`),
INGOT_TEST_MODEL the model (default: the path scripts/fetch-test-model prints), and
INGOT_SERVE_ARGS extra flags for `ingot serve` (e.g. `--device wgpu`).
"""
import os
import shlex
import socket
import subprocess
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_NAME = "smollm2"


def _model_path():
    if os.environ.get("INGOT_TEST_MODEL"):
        return os.environ["INGOT_TEST_MODEL"]
    return subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-test-model")], text=True).strip()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra):
        binary = os.environ.get("INGOT_BIN", os.path.join(ROOT, "target", "debug", "ingot"))
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "serve", "--model", _model_path(), "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", MODEL_NAME, "--max-model-len", "2048",
             *shlex.split(os.environ.get("INGOT_SERVE_ARGS", "")), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("ingot serve did not become healthy")

    def metrics(self):
        with urllib.request.urlopen(self.base + "/metrics") as r:
            lines = r.read().decode().splitlines()
        out = {}
        for line in lines:
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    s.stop()
    assert s.proc.returncode == 0, "ingot serve did not exit cleanly on SIGTERM"


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.base + "/v1", api_key="unused")


@pytest.fixture(scope="session")
def embed_server():
    """The test model served as an embedding model (last token, L2-normalized), with
    Matryoshka truncation allowed."""
    s = Server("--task", "embed", "--hf-overrides", '{"is_matryoshka": true}')
    yield s
    s.stop()
    assert s.proc.returncode == 0, "ingot serve --task embed did not exit cleanly on SIGTERM"


@pytest.fixture(scope="session")
def embed_client(embed_server):
    from openai import OpenAI
    return OpenAI(base_url=embed_server.base + "/v1", api_key="unused")
