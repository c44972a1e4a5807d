//! The tests that go through the OpenAI API of an in-process server on 127.0.0.1:
//! concurrent streaming clients, and the context limit.

use super::report::{Section, Status, Table};
use super::Plan;
use crate::bench::ms;
use crate::bench::serve::{load, random_prompt, request_body, round_trip_ids, stats};
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use ingot_engine::EngineHandle;
use ingot_model::Tokenizer;
use ingot_server::{AppState, ServerConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::future::IntoFuture;
use std::time::{Duration, Instant};

pub const CONCURRENCY: &str = "concurrency";
pub const TOKEN_CAP: &str = "token cap";

const MODEL: &str = "validate";

pub struct Server {
    base: String,
    client: reqwest::Client,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    pub async fn start(engine: EngineHandle) -> Result<Server> {
        let state = AppState::new(ServerConfig {
            served_model_name: MODEL.into(),
            api_key: None,
            max_n: 128,
            max_prompts_per_request: 256,
            max_body_bytes: 8 << 20,
            tool_parser: None,
            reasoning_parser: None,
        });
        let _ = state.engine.set(engine);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(axum::serve(listener, ingot_server::router(state)).into_future());
        Ok(Server {
            base,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(600))
                .build()?,
            task,
        })
    }

    pub async fn concurrency(&self, plan: &Plan, tokenizer: &Tokenizer) -> Result<Section> {
        let n = plan.clients * plan.requests_per_client;
        let (input, output) = (128, 32);
        let mut rng = StdRng::seed_from_u64(6);
        let pool = round_trip_ids(tokenizer)?;
        let bodies = (0..n)
            .map(|_| {
                let prompt = random_prompt(tokenizer, &pool, &mut rng, input)?;
                Ok(request_body(
                    MODEL,
                    &prompt,
                    output,
                    0.0,
                    rng.random_bool(0.5),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let url_completions = format!("{}/v1/completions", self.base);
        let url_chat = format!("{}/v1/chat/completions", self.base);
        let (chat, plain): (Vec<Value>, Vec<Value>) = bodies
            .into_iter()
            .partition(|b| b.get("messages").is_some());
        let start = Instant::now();
        // Both endpoints at once, together at most `clients` requests in flight.
        let half = plan.clients.div_ceil(2);
        let hidden = ProgressBar::hidden();
        let (a, b) = tokio::join!(
            load(
                &self.client,
                &url_completions,
                None,
                plain,
                vec![Duration::ZERO; n],
                Some(half),
                &hidden
            ),
            load(
                &self.client,
                &url_chat,
                None,
                chat,
                vec![Duration::ZERO; n],
                Some(plan.clients - half),
                &hidden
            ),
        );
        let outcomes: Vec<_> = a?.into_iter().chain(b?).collect();
        let elapsed = start.elapsed().as_secs_f64();
        let failed: Vec<&str> = outcomes.iter().filter_map(|o| o.error.as_deref()).collect();
        let short = outcomes
            .iter()
            .filter(|o| o.error.is_none() && o.tokens() != output)
            .count();
        let ok: Vec<_> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let ttft = ms(&ok.iter().filter_map(|o| o.ttft).collect::<Vec<_>>());
        let e2el = ms(&ok.iter().map(|o| o.e2el).collect::<Vec<_>>());
        let tokens: usize = ok.iter().map(|o| o.tokens()).sum();
        let (t, e) = (stats(&ttft), stats(&e2el));
        let mut table = Table::new(&["ms", "mean", "median", "p90", "p99"]);
        for (name, s) in [("TTFT", &t), ("E2EL", &e)] {
            let g = |k: &str| format!("{:.1}", s[k].as_f64().unwrap_or(f64::NAN));
            table.row(vec![
                name.into(),
                g("mean"),
                g("median"),
                g("p90"),
                g("p99"),
            ]);
        }
        let status = if failed.is_empty() && short == 0 {
            Status::Pass
        } else {
            Status::Fail
        };
        Ok(Section::new(
            format!("{} streaming HTTP clients, {} requests each of {input} prompt tokens → {output} tokens, half to /v1/completions and half to /v1/chat/completions: PASS when every request completes with all {output} tokens (usage), else FAIL.", plan.clients, plan.requests_per_client),
            status,
            format!("{} of {n} completed ({} failed, {short} short) in {elapsed:.1} s, {:.1} output tok/s; TTFT p50 {:.0} ms p99 {:.0} ms", ok.len(), failed.len(), tokens as f64 / elapsed, t["median"].as_f64().unwrap_or(f64::NAN), t["p99"].as_f64().unwrap_or(f64::NAN)),
            table,
            json!({"clients": plan.clients, "requests": n, "failed": failed.len(), "errors": failed.iter().take(5).collect::<Vec<_>>(), "short": short, "elapsed_s": elapsed, "output_tok_s": tokens as f64 / elapsed, "ttft_ms": t, "e2el_ms": e, "ttft_samples_ms": ttft, "e2el_samples_ms": e2el}),
        ))
    }

    /// POST /v1/completions with a token-id prompt: the status, the completion tokens and
    /// the finish reason or error message.
    async fn complete(&self, prompt: &[u32], max_tokens: usize) -> Result<(u16, Value)> {
        let r = self
            .client
            .post(format!("{}/v1/completions", self.base))
            .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0}))
            .send()
            .await
            .context("POST /v1/completions")?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }

    pub async fn token_cap(&self, max_len: usize, vocab: u32) -> Result<Section> {
        let mut rng = StdRng::seed_from_u64(7);
        let ids: Vec<u32> = (0..max_len + 1)
            .map(|_| rng.random_range(0..vocab))
            .collect();
        // (prompt tokens, max_tokens, expected: Ok(tokens) or Err(400))
        let cases: [(usize, usize, Option<usize>); 5] = [
            (max_len - 8, 8, Some(8)),
            (max_len - 1, 1, Some(1)),
            (max_len - 8, 9, None),
            (max_len, 1, None),
            (max_len + 1, 1, None),
        ];
        let mut table = Table::new(&["prompt tokens", "max_tokens", "expected", "got"]);
        let mut wrong = 0;
        let mut figures = vec![];
        for (prompt, max_tokens, want) in cases {
            let (status, body) = self.complete(&ids[..prompt], max_tokens).await?;
            let tokens = body["usage"]["completion_tokens"]
                .as_u64()
                .map(|t| t as usize);
            let finish = body["choices"][0]["finish_reason"].as_str().unwrap_or("");
            let expected = match want {
                Some(n) => format!("200, {n} tokens, finish length"),
                None => "400 naming the context length".into(),
            };
            let good = match want {
                Some(n) => status == 200 && tokens == Some(n) && finish == "length",
                None => {
                    status == 400
                        && body["error"]["message"]
                            .as_str()
                            .is_some_and(|m| m.contains(&max_len.to_string()))
                }
            };
            let got = if status == 200 {
                format!("200, {} tokens, finish {finish}", tokens.unwrap_or(0))
            } else {
                format!(
                    "{status}: {}",
                    body["error"]["message"].as_str().unwrap_or("(no message)")
                )
            };
            if !good {
                wrong += 1;
            }
            table.row(vec![
                prompt.to_string(),
                max_tokens.to_string(),
                expected,
                got.replace('|', "/"),
            ]);
            figures.push(json!({"prompt": prompt, "max_tokens": max_tokens, "status": status, "tokens": tokens, "as_expected": good}));
        }
        Ok(Section::new(
            format!("max_model_len is {max_len}: a request whose prompt plus max_tokens fits runs to max_tokens (finish `length`); one that does not fit, or whose prompt alone fills the context, is a 400 whose message names the limit; nothing is truncated silently. PASS when all {} cases behave so, else FAIL.", cases.len()),
            if wrong == 0 { Status::Pass } else { Status::Fail },
            format!("{} of {} cases as expected", cases.len() - wrong, cases.len()),
            table,
            json!(figures),
        ))
    }
}
