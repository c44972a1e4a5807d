//! Before the model has loaded the server answers, but only with 503s (metrics excepted).

use ingot_server::{AppState, ServerConfig};
use std::future::IntoFuture;

#[tokio::test]
async fn everything_but_metrics_is_503_while_loading() {
    let state = AppState::new(ServerConfig {
        served_model_name: "m".into(),
        api_key: None,
        max_n: 128,
        max_prompts_per_request: 256,
        max_body_bytes: 1 << 20,
        tool_parser: None,
        reasoning_parser: None,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(axum::serve(listener, ingot_server::router(state)).into_future());
    assert_eq!(
        reqwest::get(format!("{base}/health"))
            .await
            .unwrap()
            .status(),
        503
    );
    let r = reqwest::get(format!("{base}/v1/models")).await.unwrap();
    assert_eq!(r.status(), 503);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "service_unavailable");
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .body(r#"{"prompt": "hi"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(
        reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .status(),
        200
    );
}
