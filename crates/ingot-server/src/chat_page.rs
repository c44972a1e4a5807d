//! The chat page at `/`: one static page built into the binary (no fetches beyond this
//! server), which streams answers from `/v1/chat/completions`. Its content security
//! policy allows only this server's own script, style and API, so even markup that
//! slipped into a rendered answer could neither run nor load anything.

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("chat_page/index.html");
const SCRIPT: &str = include_str!("chat_page/chat.js");
const STYLE: &str = include_str!("chat_page/chat.css");

const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

/// The page's routes; they need no API key (the page asks for one when the API does).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/ui/chat.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/chat.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}
