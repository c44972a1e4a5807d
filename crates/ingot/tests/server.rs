//! `ingot serve` on 127.0.0.1 with a tiny synthetic model: every endpoint, the error cases,
//! disconnects and graceful shutdown.

use ingot_model::synthetic::SyntheticSpec;
use ingot_model::Arch;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server {
    child: Child,
    base: String,
    dir: std::path::PathBuf,
}

impl Server {
    async fn start(tag: &str, extra: &[&str]) -> Server {
        Self::start_with(tag, extra, |_| {}).await
    }

    /// As [`start`](Self::start), with `prepare` run on the model directory first.
    async fn start_with(tag: &str, extra: &[&str], prepare: fn(&std::path::Path)) -> Server {
        Self::launch(tag, extra, prepare, &[], Stdio::null()).await
    }

    /// As [`start_with`](Self::start_with), with variables `env` set for the server and
    /// its standard error sent to `stderr`.
    async fn launch(
        tag: &str,
        extra: &[&str],
        prepare: fn(&std::path::Path),
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Server {
        let dir = std::env::temp_dir().join(format!("ingot-server-{tag}-{}", std::process::id()));
        SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
        prepare(&dir);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(env!("CARGO_BIN_EXE_ingot"))
            .args([
                "serve",
                "--model",
                dir.to_str().unwrap(),
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .args(["--served-model-name", "tiny", "--threads", "1"])
            .args(if extra.contains(&"--kv-cache-memory") {
                &[][..]
            } else {
                &["--kv-cache-memory", "4000000"][..]
            })
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut s = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if status(&format!("{}/health", s.base)).await == Some(200) {
                return s;
            }
            if let Some(exit) = s.child.try_wait().unwrap() {
                panic!("the server exited at start: {exit}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("server did not become healthy");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn status(url: &str) -> Option<u16> {
    reqwest::get(url).await.ok().map(|r| r.status().as_u16())
}

async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn post_raw(base: &str, path: &str, body: Vec<u8>, key: Option<&str>) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The `data:` payloads of an SSE body.
async fn sse(base: &str, path: &str, body: Value) -> Vec<String> {
    let text = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(String::from)
        .collect()
}

async fn metric(base: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{name} "))
                .map(|v| v.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("{name} missing"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_streaming_and_errors() {
    let s = Server::start("main", &["--max-model-len", "256"]).await;
    let b = s.base.as_str();
    let v: Value = reqwest::get(format!("{b}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");
    let v: Value = reqwest::get(format!("{b}/version"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v["version"].is_string());

    // Completions: plain, token-id prompts, several prompts with n, echo, logprobs.
    let greedy = json!({"model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 7, "temperature": 0, "ignore_eos": true});
    let (st, plain) = post(b, "/v1/completions", greedy.clone()).await;
    assert_eq!(st, 200, "{plain}");
    assert_eq!(
        plain["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10})
    );
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let (_, ids) = post(
        b,
        "/v1/completions",
        json!({"prompt": [3, 4, 5], "max_tokens": 7, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(ids["choices"][0]["text"], text.as_str());
    let (_, many) = post(b, "/v1/completions", json!({"prompt": ["w3", "w9 w8"], "n": 2, "max_tokens": 3, "temperature": 0.7, "seed": 1, "echo": true, "logprobs": 2})).await;
    let choices = many["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert!(choices[2]["text"].as_str().unwrap().starts_with("w9 w8"));
    assert_eq!(
        choices[0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .len(),
        2
    );

    // Streamed greedy text equals the plain text; usage comes last, then [DONE].
    let events = sse(b, "/v1/completions", json!({"prompt": "w3 w4 w5", "max_tokens": 7, "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 7);

    // Chat, plain and streamed.
    let chat = json!({"messages": [{"role": "system", "content": "w2"}, {"role": "user", "content": [{"type": "text", "text": "w7 w8"}]}], "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (st, c) = post(b, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    let mut streamed_chat = chat.clone();
    streamed_chat["stream"] = json!(true);
    let events = sse(b, "/v1/chat/completions", streamed_chat).await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        c["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // Tokenize / detokenize.
    let (_, t) = post(b, "/tokenize", json!({"prompt": "w5 w6"})).await;
    assert_eq!(t["tokens"], json!([5, 6]));
    let (_, d) = post(b, "/detokenize", json!({"tokens": [5, 6]})).await;
    assert!(d["prompt"].as_str().unwrap().contains("w5"));

    // Errors, each in OpenAI's shape.
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "w3", "temperature": -1}),
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "w3", "best_of": 3}),
            400,
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "w3", "frobnicate": 1}),
            400,
            "frobnicate",
        ),
        (
            "/v1/completions",
            json!({"prompt": "w3 ".repeat(300)}),
            400,
            "maximum context length is 256 tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "w3", "max_tokens": 1000}),
            400,
            "maximum context length is 256 tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": [5000]}),
            400,
            "outside the vocabulary",
        ),
        (
            "/v1/completions",
            json!({"prompt": "w3", "model": "other"}),
            404,
            "does not exist",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "w1"}], "tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            400,
            "not in `tools`",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "w1"}], "response_format": {"type": "xml"}}),
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            "messages",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (st, e) = post(b, path, body.clone()).await;
        assert_eq!(st, status, "{body} -> {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(needle),
            "{body} -> {e}"
        );
        assert!(e["error"]["type"].is_string());
    }
    let (st, e) = post_raw(b, "/v1/completions", b"{not json".to_vec(), None).await;
    assert_eq!(st, 400, "{e}");
    let (st, _) = post_raw(b, "/v1/completions", vec![b' '; 9 << 20], None).await;
    assert_eq!(st, 413);

    // A client that disconnects mid-stream leaves no block in use.
    for _ in 0..10 {
        let mut r = reqwest::Client::new()
            .post(format!("{b}/v1/completions"))
            .json(
                &json!({"prompt": "w3 w4", "max_tokens": 200, "ignore_eos": true, "stream": true}),
            )
            .send()
            .await
            .unwrap();
        r.chunk().await.unwrap();
        drop(r);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(b, "ingot:kv_cache_usage_perc").await > 0.0
        || metric(b, "ingot:num_requests_running").await > 0.0
    {
        assert!(
            Instant::now() < deadline,
            "blocks still in use after disconnects"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(metric(b, "ingot:generation_tokens_total").await > 0.0);
    let text = reqwest::get(format!("{b}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "ingot:time_to_first_token_seconds_count",
        "ingot:e2e_request_latency_seconds_count",
        "ingot:prefix_cache_queries_total",
    ] {
        assert!(text.contains(name), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_queue_limit_and_graceful_shutdown() {
    let mut s = Server::start("key", &["--api-key", "sekret"]).await;
    let b = s.base.clone();
    let body = br#"{"prompt": "w3", "max_tokens": 2}"#.to_vec();
    let (st, e) = post_raw(&b, "/v1/completions", body.clone(), None).await;
    assert_eq!(
        (st, e["error"]["type"].as_str()),
        (401, Some("authentication_error"))
    );
    assert_eq!(
        post_raw(&b, "/v1/completions", body.clone(), Some("wrong"))
            .await
            .0,
        401
    );
    assert_eq!(
        post_raw(&b, "/v1/completions", body.clone(), Some("sekret"))
            .await
            .0,
        200
    );
    let chat = br#"{"messages": [{"role": "user", "content": "w3"}], "max_tokens": 2}"#.to_vec();
    assert_eq!(
        post_raw(&b, "/v1/chat/completions", chat.clone(), None)
            .await
            .0,
        401
    );
    assert_eq!(
        post_raw(&b, "/v1/chat/completions", chat, Some("sekret"))
            .await
            .0,
        200
    );
    assert_eq!(status(&format!("{b}/v1/models")).await, Some(401));
    // The chat page loads without the key (it asks for it) and allows only its own assets.
    for (path, kind) in [
        ("/", "text/html"),
        ("/ui/chat.js", "text/javascript"),
        ("/ui/chat.css", "text/css"),
    ] {
        let r = reqwest::get(format!("{b}{path}")).await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let header = |name: &str| r.headers()[name].to_str().unwrap().to_string();
        assert!(header("content-type").starts_with(kind), "{path}");
        assert!(header("content-security-policy").contains("script-src 'self'"));
    }
    assert_eq!(
        status(&format!("{b}/health")).await,
        Some(200),
        "/health needs no key"
    );
    // SIGTERM: exit 0.
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(Instant::now() < deadline, "server did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }

    let full = Server::start("full", &["--max-waiting", "0"]).await;
    let (st, e) = post(&full.base, "/v1/completions", json!({"prompt": "w3"})).await;
    assert_eq!(st, 503, "{e}");
}

/// Polls until no request, sequence or block is left in the engine, for at most `limit`.
async fn drained_within(base: &str, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = [
            "ingot:num_requests_waiting",
            "ingot:num_requests_running",
            "ingot:num_sequences_waiting",
            "ingot:num_sequences_running",
            "ingot:kv_cache_blocks_in_use",
        ];
        let mut busy = vec![];
        for name in left {
            let v = metric(base, name).await;
            if v > 0.0 {
                busy.push(format!("{name} {v}"));
            }
        }
        if busy.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(busy.join(", "));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_cannot_wedge_the_server() {
    let mut s = Server::start(
        "wedge",
        &[
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--kv-cache-memory",
            "64000000",
            "--max-waiting",
            "1000",
        ],
    )
    .await;
    let b = s.base.clone();
    let long = |n: usize, stream: bool| json!({"prompt": "w3 w4", "max_tokens": 200, "ignore_eos": true, "n": n, "stream": stream});

    // Over the limits: 400s that name the field.
    for (body, param) in [
        (json!({"prompt": "w3", "n": 129}), "n"),
        (json!({"prompt": "w3", "n": 1_000_000}), "n"),
        (json!({"prompt": vec!["w3"; 257]}), "prompt"),
        (json!({"prompt": "w3", "stop": vec!["x"; 65]}), "stop"),
    ] {
        let (st, e) = post(&b, "/v1/completions", body).await;
        assert_eq!(
            (st, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{e}"
        );
    }
    // 128 samples of 250 tokens cannot all be in this cache at once.
    let small = Server::start("wedge-small", &["--max-model-len", "256"]).await;
    let (st, e) = post(
        &small.base,
        "/v1/completions",
        json!({"prompt": "w3", "n": 128, "max_tokens": 250}),
    )
    .await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("n")), "{e}");
    drop(small);

    // The largest `n`, streamed, and a list of many prompts: the client leaves after the
    // first chunk and every sequence goes, queued siblings and prompts included.
    let many = json!({"prompt": vec!["w3 w4"; 256], "max_tokens": 200, "ignore_eos": true, "stream": true});
    for body in [long(128, true), many] {
        let mut r = reqwest::Client::new()
            .post(format!("{b}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.chunk().await.unwrap();
        assert!(metric(&b, "ingot:num_sequences_waiting").await > 0.0);
        drop(r);
        drained_within(&b, Duration::from_secs(1)).await.unwrap();
        let (st, e) = post(
            &b,
            "/v1/completions",
            json!({"prompt": "w3", "max_tokens": 3}),
        )
        .await;
        assert_eq!(st, 200, "{e}");
    }
    // The same when a non-streaming client gives up before the answer.
    let gave_up = reqwest::Client::new()
        .post(format!("{b}/v1/completions"))
        .timeout(Duration::from_millis(300))
        .json(&long(128, false))
        .send()
        .await;
    assert!(gave_up.unwrap_err().is_timeout());
    drained_within(&b, Duration::from_secs(1)).await.unwrap();

    // Admission counts sequences: 8 requests of 125 samples fill the queue of 1,000.
    let client = reqwest::Client::new();
    let mut queued = vec![];
    for _ in 0..8 {
        let (client, url, body) = (
            client.clone(),
            format!("{b}/v1/completions"),
            long(125, false),
        );
        queued.push(tokio::spawn(async move {
            client
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&b, "ingot:num_sequences_waiting").await
        + metric(&b, "ingot:num_sequences_running").await
        < 1000.0
    {
        assert!(Instant::now() < deadline, "requests were not queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (st, e) = post(&b, "/v1/completions", json!({"prompt": "w3", "n": 8})).await;
    assert_eq!(st, 503, "{e}");

    // SIGTERM aborts what has not started; the few running finish and the process exits.
    let pid = s.child.id().to_string();
    let term = Instant::now();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    for q in queued {
        assert_eq!(q.await.unwrap(), 503);
    }
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            term.elapsed() < Duration::from_secs(4),
            "the server did not exit within 4 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ingot bench serve --format json` against `base`.
async fn bench_serve(base: &str, dir: &std::path::Path, extra: &[&str]) -> Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ingot"));
    cmd.args(["bench", "serve", "--base-url", base, "--tokenizer"])
        .arg(dir)
        .args([
            "--num-prompts",
            "6",
            "--input-len",
            "12",
            "--output-len",
            "5",
        ])
        .args(["--format", "json"])
        .args(extra);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_counts_tokens_and_failures() {
    let s = Server::start("bench", &[]).await;
    let saved = s.dir.join("result.json");
    let r = bench_serve(
        &s.base,
        &s.dir,
        &[
            "--max-concurrency",
            "3",
            "--save-result",
            saved.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64()),
        (Some(6), Some(0)),
        "{r}"
    );
    assert_eq!(r["model"], "tiny", "the name comes from /v1/models");
    assert_eq!(r["usage_reported"], true);
    assert_eq!(r["total_output_tokens"], 30, "{r}");
    assert!(r["total_input_tokens"].as_u64().unwrap() >= 72, "{r}");
    for key in ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"] {
        assert!(r[key]["p99"].as_f64().unwrap() >= r[key]["median"].as_f64().unwrap());
    }
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let requests = saved["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 6);
    assert!(requests
        .iter()
        .all(|q| q["itl_ms"].as_array().unwrap().len() == 4));

    let r = bench_serve(
        &s.base,
        &s.dir,
        &["--model", "absent", "--request-rate", "50"],
    )
    .await;
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64()),
        (Some(0), Some(6)),
        "{r}"
    );
    assert!(r["errors"][0].as_str().unwrap().contains("404"), "{r}");
    assert!(r["ttft_ms"].is_null());
}

fn mean_pooling_files(dir: &std::path::Path) {
    ingot_model::pooling::write_sentence_transformers(
        dir,
        ingot_model::PoolingType::Mean,
        true,
        64,
    )
    .unwrap();
}

/// A model directory with sentence-transformers' pooling files serves embeddings without
/// `--task`, and not text; `--task generate` turns that around.
#[tokio::test]
async fn pooling_files_turn_embeddings_on() {
    let s = Server::start_with(
        "embed",
        &["--max-prompts-per-request", "4"],
        mean_pooling_files,
    )
    .await;
    let (code, v) = post(
        &s.base,
        "/v1/embeddings",
        json!({"input": [[1, 2, 3], [4]]}),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for d in data {
        let e: Vec<f64> = serde_json::from_value(d["embedding"].clone()).unwrap();
        assert_eq!(e.len(), 64);
        assert!((e.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);
    }
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    let (code, v) = post(
        &s.base,
        "/v1/embeddings",
        json!({"input": [[1], [2], [3], [4], [5]]}),
    )
    .await;
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("input")),
        "{v}"
    );
    let (code, v) = post(&s.base, "/v1/completions", json!({"prompt": [1, 2]})).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--task embed"));

    let g = Server::start_with("embed-gen", &["--task", "generate"], mean_pooling_files).await;
    let (code, v) = post(&g.base, "/v1/embeddings", json!({"input": [[1, 2]]})).await;
    assert_eq!(code, 400, "{v}");
    let (code, v) = post(
        &g.base,
        "/v1/completions",
        json!({"prompt": [1, 2], "max_tokens": 2}),
    )
    .await;
    assert_eq!(code, 200, "{v}");
}

fn qwen3_moe(dir: &std::path::Path) {
    SyntheticSpec::tiny(Arch::Qwen3Moe).write(dir).unwrap();
}

/// A mixture-of-experts model (a tiny random Qwen3-MoE) serves completions, chat and
/// streams.
#[tokio::test]
async fn a_mixture_of_experts_model_serves() {
    let s = Server::start_with("moe", &[], qwen3_moe).await;
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 6, "n": 2, "temperature": 0.7, "seed": 3, "ignore_eos": true});
    let (code, v) = post(&s.base, "/v1/completions", body).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    let chat = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4});
    let (code, v) = post(&s.base, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(code, 200, "{v}");
    let mut stream = chat;
    stream["stream"] = json!(true);
    let events = sse(&s.base, "/v1/chat/completions", stream).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

/// A tensor-parallel rank that fails (`INGOT_FAIL_RANK`) ends `ingot serve`: the request in
/// flight gets the rank's error and the process exits with it.
#[tokio::test]
async fn a_failing_rank_ends_the_server_with_its_error() {
    let mut s = Server::launch(
        "tp-fail",
        &["--tensor-parallel-size", "2"],
        |_| {},
        &[("INGOT_FAIL_RANK", "1:3")],
        Stdio::piped(),
    )
    .await;
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": true});
    let (code, v) = post(&s.base, "/v1/completions", body).await;
    assert_eq!(code, 500, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("failure injected at step 3"), "{v}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(exit) = s.child.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "the server is still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(exit.code(), Some(1));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut s.child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        stderr.contains("error: the engine stopped: rank 1: failure injected at step 3"),
        "{stderr}"
    );
}
