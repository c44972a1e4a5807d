"""`/v1/embeddings` through the openai client, against the test model served with
`--task embed` (last-token pooling, L2-normalized)."""
import json
import math
import urllib.request

import openai
import pytest
import struct

HIDDEN = 576  # SmolLM2-135M's hidden size

DOCS = [
    "Paris is the capital and largest city of France.",
    "Bananas are yellow fruit that grow in bunches.",
    "The Eiffel Tower was built for the 1889 World's Fair.",
]


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def f32(v):
    """The f32 values JSON's shortest decimal forms stand for."""
    return list(struct.unpack(f"{len(v)}f", struct.pack(f"{len(v)}f", *v)))


def tokenize(server, text):
    req = urllib.request.Request(server.base + "/tokenize", data=json.dumps({"prompt": text}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


def test_strings_give_normalized_vectors_in_order(embed_client, embed_server):
    # The client asks for base64 by default and decodes it.
    r = embed_client.embeddings.create(model="smollm2", input=DOCS)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d in r.data:
        assert len(d.embedding) == HIDDEN
        assert abs(norm(d.embedding) - 1) < 1e-5
    assert r.data[0].embedding != r.data[1].embedding
    assert r.usage.prompt_tokens == sum(len(tokenize(embed_server, t)) for t in DOCS)
    assert r.usage.total_tokens == r.usage.prompt_tokens


def test_float_base64_token_ids_and_batching_agree(embed_client, embed_server):
    one = embed_client.embeddings.create(model="smollm2", input=DOCS[0], encoding_format="float")
    b64 = embed_client.embeddings.create(model="smollm2", input=DOCS[0])
    ids = tokenize(embed_server, DOCS[0])
    by_ids = embed_client.embeddings.create(model="smollm2", input=ids, encoding_format="float")
    lists = embed_client.embeddings.create(model="smollm2", input=[ids, ids[:3]], encoding_format="float")
    batch = embed_client.embeddings.create(model="smollm2", input=DOCS, encoding_format="float")
    want = one.data[0].embedding
    assert b64.data[0].embedding == f32(want)
    assert by_ids.data[0].embedding == want
    assert lists.data[0].embedding == want
    assert len(lists.data[1].embedding) == HIDDEN
    # In a batch with other inputs, the same vector up to rounding.
    assert max(abs(a - b) for a, b in zip(batch.data[0].embedding, want)) < 1e-4


def test_dimensions_truncate_then_renormalize(embed_client):
    full = embed_client.embeddings.create(model="smollm2", input=DOCS[1], encoding_format="float")
    cut = embed_client.embeddings.create(model="smollm2", input=DOCS[1], dimensions=64,
                                         encoding_format="float")
    v = cut.data[0].embedding
    assert len(v) == 64
    assert abs(norm(v) - 1) < 1e-5
    head = full.data[0].embedding[:64]
    n = norm(head)
    assert max(abs(a - b / n) for a, b in zip(v, head)) < 1e-5


def test_bad_requests_are_400s(embed_client):
    with pytest.raises(openai.BadRequestError, match="empty"):
        embed_client.embeddings.create(model="smollm2", input=[])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        embed_client.embeddings.create(model="smollm2", input=[[1] * 3000])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        embed_client.embeddings.create(model="smollm2", input="x", dimensions=100000)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        embed_client.embeddings.create(model="smollm2", input=[[10**8]])
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        embed_client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        embed_client.embeddings.create(model="other", input="x")
    # The server goes on serving.
    assert len(embed_client.embeddings.create(model="smollm2", input="still here").data) == 1


def test_a_generating_server_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        client.embeddings.create(model="smollm2", input="x")


def test_retrieval_ranks_by_cosine(embed_client):
    # The README's example: documents, a query, cosine ranking (vectors are unit length).
    docs = embed_client.embeddings.create(model="smollm2", input=DOCS).data
    query = embed_client.embeddings.create(model="smollm2", input="What is the capital of France?").data[0]
    scores = [sum(a * b for a, b in zip(query.embedding, d.embedding)) for d in docs]
    assert all(-1.0001 <= s <= 1.0001 for s in scores)
    # A chat model, not trained for retrieval, still puts the document that answers first
    # (0.734 against 0.686 and 0.688 on 2026-11-27).
    assert scores.index(max(scores)) == 0, scores
