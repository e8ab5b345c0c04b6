//! `host serve`: an OpenAI-compatible HTTP server. The HTTP side (axum on tokio) checks each
//! request and turns tokens into text; one engine thread owns the model and the drafter and
//! runs every request as a row of one continuously batched, speculating verify loop.

mod engine;
mod metrics;
mod openai;
mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::chat::ChatTemplate;
use crate::generate::{Generation, StopReason};
use crate::run::{RunError, RunOptions};
use crate::sampling::TokenLogprob;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use engine::{Job, JobEvent};
use metrics::Metrics;
use openai::{ApiError, Endpoint, Prepared, Served};
use text::StopText;

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub run: RunOptions,
    pub host: String,
    pub port: u16,
    /// Requests must carry `Authorization: Bearer <key>` (all but `/health`).
    pub api_key: Option<String>,
    /// Rows in the running batch at most.
    pub max_batch: usize,
    /// Requests waiting to join the batch at most; more are answered 429.
    pub max_queue: usize,
    /// Bound of the prefix cache in MiB of target caches (0: none).
    pub prefix_cache_mb: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Load(#[from] RunError),
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error("cannot listen on {address}: {error}")]
    Bind { address: String, error: std::io::Error },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the engine thread stopped before it was ready")]
    EngineGone,
    #[error("{0}")]
    Ranks(String),
}

struct App {
    served: Served,
    jobs: SyncSender<Job>,
    metrics: Arc<Metrics>,
    api_key: Option<String>,
    next_id: AtomicU64,
}

/// A rank other than 0 of a sharded target under `host launch`: no HTTP, only the engine,
/// following rank 0's batch until rank 0 stops serving. Interrupts are rank 0's to handle.
pub fn follow(options: ServeOptions) -> Result<(), ServeError> {
    kernels::os::signals::ignore_stop_requests();
    engine::follow(options.run, options.prefix_cache_mb << 20)
}

/// Loads the manifest's model and drafter, then serves until SIGTERM or Ctrl-C, after which it
/// takes no new connection and finishes the requests in flight. `on_listening` is told the
/// bound address (the port may have been 0); `warn` what the user should know.
pub fn serve(
    options: ServeOptions,
    on_listening: impl FnOnce(SocketAddr),
    warn: impl FnMut(String) + Send + 'static,
) -> Result<(), ServeError> {
    // The address is taken before the model loads, so that a port in use costs no load.
    let address = format!("{}:{}", options.host, options.port);
    let listener =
        std::net::TcpListener::bind(&address).map_err(|error| ServeError::Bind { address: address.clone(), error })?;
    listener.set_nonblocking(true)?;
    let metrics = Arc::new(Metrics::new());
    let (jobs, queue) = sync_channel(options.max_queue);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let engine = {
        let (run, max_batch, metrics) = (options.run.clone(), options.max_batch, metrics.clone());
        let prefix_cache_bytes = options.prefix_cache_mb << 20;
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || engine::run(run, max_batch, prefix_cache_bytes, queue, ready_tx, metrics, warn))?
    };
    let ready = ready_rx.recv().map_err(|_| ServeError::EngineGone)??;
    let model_dir = ready.model_dir.clone();
    let name = model_dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let served = Served {
        name,
        ready,
        tokenizer: Tokenizer::load(&model_dir).map_err(RunError::from)?,
        template: ChatTemplate::load(&model_dir)?,
    };
    let app = Arc::new(App { served, jobs, metrics, api_key: options.api_key.clone(), next_id: AtomicU64::new(0) });

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        on_listening(listener.local_addr()?);
        axum::serve(listener, router(app)).with_graceful_shutdown(shutdown_signal()).await?;
        Ok(())
    });
    // With the runtime gone, so is every job sender: the engine finishes what it holds and
    // returns.
    drop(runtime);
    engine.join().map_err(|_| ServeError::EngineGone)?;
    result
}

fn router(app: Arc<App>) -> Router {
    let authorized = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics_text))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_key));
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .merge(authorized)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, None, "no such endpoint").into_response() })
        .layer(middleware::map_response(as_openai_error))
        .with_state(app)
}

/// Every error response in the OpenAI error shape, whichever layer made it (axum's own 405 and
/// 413 are plain text): its status, with its text as the message.
async fn as_openai_error(response: Response) -> Response {
    let status = response.status();
    let is_json =
        response.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 64 << 10).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_owned();
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_owned() } else { text };
    ApiError::new(status, None, message).into_response()
}

/// The key of an `Authorization: Bearer <key>` header; the scheme's case does not matter
/// (RFC 9110).
fn bearer_key(value: &str) -> Option<&str> {
    let (scheme, key) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// Resolves at the first Ctrl-C or SIGTERM (`kernels::os::signals`, polled: a shutdown need
/// not start within the millisecond).
async fn shutdown_signal() {
    kernels::os::signals::watch_stop_requests();
    while kernels::os::signals::take_stop_request().is_none() {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

async fn require_key(State(app): State<Arc<App>>, request: HttpRequest, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if given.and_then(bearer_key) != Some(key.as_str()) {
            app.metrics.count("rejected");
            let why = if given.is_some() { "the API key is wrong" } else { "an API key is required" };
            return ApiError::new(StatusCode::UNAUTHORIZED, None, format!("{why}: send `Authorization: Bearer <key>`"))
                .into_response();
        }
    }
    next.run(request).await
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": app.served.name, "object": "model", "created": now(), "owned_by": "host"}],
    }))
}

async fn metrics_text(State(app): State<Arc<App>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.text())
}

async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    generate(app, Endpoint::Completions, body).await
}

async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    generate(app, Endpoint::Chat, body).await
}

async fn generate(app: Arc<App>, endpoint: Endpoint, body: Bytes) -> Response {
    let received = Instant::now();
    let number = app.next_id.fetch_add(1, Ordering::Relaxed);
    let seed = now().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ number;
    let prepared = match openai::parse(&body).and_then(|b| app.served.prepare(endpoint, b, seed)) {
        Ok(p) => p,
        Err(e) => {
            app.metrics.count("rejected");
            return e.into_response();
        }
    };
    let choices = match submit(&app, &prepared) {
        Ok(choices) => choices,
        Err(refused) => return refused.into_response(),
    };
    let reply =
        Arc::new(Reply { app: app.clone(), endpoint, id: reply_id(endpoint, number), created: now(), prepared });
    if reply.prepared.stream {
        return stream(reply, choices, received);
    }
    // The rows run together in the engine; their events wait in their channels meanwhile. One
    // that fails or loses its client ends the others.
    let stops: Vec<Arc<AtomicBool>> = choices.iter().map(|(_, stop)| stop.clone()).collect();
    let stop_all = || stops.iter().for_each(|stop| stop.store(true, Ordering::Relaxed));
    let mut finished = Vec::with_capacity(choices.len());
    for (i, (events, stop)) in choices.into_iter().enumerate() {
        let (mut text, mut logprobs) = (String::new(), Vec::new());
        let timed = i == 0;
        match drive(&app, &reply.prepared, events, &stop, received, timed, |piece, l| {
            text.push_str(piece);
            logprobs.extend(l);
            true
        })
        .await
        {
            Outcome::Finished(g, stopped) => finished.push(Choice { text, logprobs, generation: g, stopped }),
            Outcome::Failed(message) => {
                stop_all();
                app.metrics.count("failed");
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, None, message).into_response();
            }
            Outcome::Gone => {
                stop_all();
                return StatusCode::NO_CONTENT.into_response();
            }
        }
    }
    app.metrics.count("ok");
    Json(reply.whole(&finished)).into_response()
}

/// A choice's events from the engine, and the flag that stops its row.
type Row = (UnboundedReceiver<JobEvent>, Arc<AtomicBool>);

/// Queues one row per choice, each with its own seed stream (`seed + i`); they share the
/// prompt's prefill through the prefix cache. When the queue refuses one, the rows already
/// queued are stopped and the response says why.
fn submit(app: &App, prepared: &Prepared) -> Result<Vec<Row>, ApiError> {
    let mut rows: Vec<Row> = Vec::with_capacity(prepared.n);
    for i in 0..prepared.n {
        let (events_tx, events) = unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut request = prepared.request.clone();
        request.sampling.seed = request.sampling.seed.wrapping_add(i as u64);
        let job = Job { request, events: events_tx, stop: stop.clone(), draft_tokens: prepared.draft_tokens };
        app.metrics.queue_depth.inc();
        if let Err(e) = app.jobs.try_send(job) {
            app.metrics.queue_depth.dec();
            app.metrics.count("rejected");
            rows.iter().for_each(|(_, stop)| stop.store(true, Ordering::Relaxed));
            return Err(match e {
                TrySendError::Full(_) => {
                    ApiError::new(StatusCode::TOO_MANY_REQUESTS, None, "the queue is full; retry shortly")
                }
                TrySendError::Disconnected(_) => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, None, "the server is shutting down")
                }
            });
        }
        rows.push((events, stop));
    }
    Ok(rows)
}

/// Server-sent events: one chunk per piece of text of each choice (its `index` says which),
/// then each choice's finish reason; once all have finished, the usage when asked for, and
/// `[DONE]`. A client that disconnects ends its rows at their next token.
fn stream(
    reply: Arc<Reply>,
    choices: Vec<(UnboundedReceiver<JobEvent>, Arc<AtomicBool>)>,
    received: Instant,
) -> Response {
    let (tx, rx) = unbounded_channel::<Result<SseEvent, std::convert::Infallible>>();
    let send = |tx: &UnboundedSender<_>, value: Value| tx.send(Ok(SseEvent::default().data(value.to_string()))).is_ok();
    if reply.endpoint == Endpoint::Chat {
        for i in 0..choices.len() {
            send(&tx, reply.chunk(i, json!({"role": "assistant", "content": ""}), None));
        }
    }
    let rows: Vec<_> = choices
        .into_iter()
        .enumerate()
        .map(|(i, (events, stop))| {
            let (reply, tx) = (reply.clone(), tx.clone());
            tokio::spawn(async move {
                let mut offset = 0;
                let outcome = drive(&reply.app, &reply.prepared, events, &stop, received, i == 0, |piece, l| {
                    let delta = match reply.endpoint {
                        Endpoint::Chat => json!({"content": piece}),
                        Endpoint::Completions => json!(piece),
                    };
                    let mut chunk = reply.chunk(i, delta, None);
                    if reply.prepared.request.logprobs.is_some() {
                        chunk["choices"][0]["logprobs"] = reply.logprobs(&l, &mut offset);
                    }
                    send(&tx, chunk)
                })
                .await;
                if let Outcome::Finished(g, stopped) = &outcome {
                    let empty = if reply.endpoint == Endpoint::Chat { json!({}) } else { json!("") };
                    send(&tx, reply.chunk(i, empty, Some(finish_reason(g, *stopped))));
                }
                outcome
            })
        })
        .collect();
    tokio::spawn(async move {
        let app = reply.app.clone();
        let mut generations = Vec::new();
        for row in rows {
            match row.await.unwrap_or_else(|e| Outcome::Failed(format!("a choice's task failed: {e}"))) {
                Outcome::Finished(g, _) => generations.push(g),
                Outcome::Failed(message) => {
                    app.metrics.count("failed");
                    send(&tx, ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, None, message).body());
                    let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
                Outcome::Gone => return,
            }
        }
        app.metrics.count("ok");
        if reply.prepared.include_usage {
            send(&tx, reply.usage_chunk(&generations));
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)).into_response()
}

/// A finished choice: its text, the log-probabilities of its tokens when asked for, its
/// generation, and whether a stop string ended it.
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    generation: Box<Generation>,
    stopped: bool,
}

enum Outcome {
    /// The generation, and whether a stop string ended its text.
    Finished(Box<Generation>, bool),
    Failed(String),
    /// The client left.
    Gone,
}

/// Turns the engine's tokens into text for `emit`, cut at the first stop string (after which
/// the row is told to stop). `emit` answers false when the client is gone.
async fn drive(
    app: &App,
    prepared: &Prepared,
    mut events: UnboundedReceiver<JobEvent>,
    stop: &AtomicBool,
    received: Instant,
    timed: bool,
    mut emit: impl FnMut(&str, Vec<TokenLogprob>) -> bool,
) -> Outcome {
    let mut decoder = StreamDecoder::new(&app.served.tokenizer);
    // Log-probabilities of tokens whose text has not been emitted yet.
    let mut pending = Vec::new();
    let mut text = StopText::new(prepared.stops.clone());
    let mut last_token: Option<Instant> = None;
    while let Some(event) = events.recv().await {
        match event {
            JobEvent::Token(token) => {
                // Latencies are the first choice's: the others' events may wait in their
                // channels until it has finished.
                let now = Instant::now();
                match (timed, last_token) {
                    (false, _) => {}
                    (true, None) => app.metrics.time_to_first_token.observe((now - received).as_secs_f64()),
                    (true, Some(t)) => app.metrics.inter_token_latency.observe((now - t).as_secs_f64()),
                }
                last_token = Some(now);
                let piece = text.push(&decoder.push(token));
                if !piece.is_empty() && !emit(&piece, std::mem::take(&mut pending)) {
                    return Outcome::Gone;
                }
                if text.stopped() {
                    stop.store(true, Ordering::Relaxed);
                }
            }
            JobEvent::Done(generation) => {
                let stopped = text.stopped();
                if !stopped {
                    let rest = text.push(&decoder.finish()) + &text.finish();
                    if (!rest.is_empty() || !pending.is_empty()) && !emit(&rest, std::mem::take(&mut pending)) {
                        return Outcome::Gone;
                    }
                }
                return Outcome::Finished(generation, stopped);
            }
            JobEvent::Logprob(l) => pending.push(l),
            JobEvent::Failed(message) => return Outcome::Failed(message),
        }
    }
    Outcome::Failed("the engine stopped".into())
}

/// The fields every response of one request shares.
struct Reply {
    app: Arc<App>,
    endpoint: Endpoint,
    id: String,
    created: u64,
    prepared: Prepared,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// The response, one choice per finished row.
    fn whole(&self, finished: &[Choice]) -> Value {
        let choices: Vec<Value> = finished
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut choice = match self.endpoint {
                    Endpoint::Completions => json!({"index": i, "text": c.text}),
                    Endpoint::Chat => json!({"index": i, "message": {"role": "assistant", "content": c.text}}),
                };
                choice["logprobs"] = match self.prepared.request.logprobs {
                    Some(_) => self.logprobs(&c.logprobs, &mut 0),
                    None => Value::Null,
                };
                choice["finish_reason"] = json!(finish_reason(&c.generation, c.stopped));
                if finished.len() > 1 {
                    // Extension: each choice's own usage beside the request's.
                    choice["usage"] = usage(std::slice::from_ref(&c.generation));
                }
                choice
            })
            .collect();
        let generations: Vec<Box<Generation>> = finished.iter().map(|c| c.generation.clone()).collect();
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.app.served.name,
            "choices": choices, "usage": usage(&generations),
        })
    }

    fn chunk(&self, index: usize, delta: Value, finish_reason: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": index, "text": delta, "logprobs": null, "finish_reason": finish_reason})
            }
            Endpoint::Chat => {
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
            }
        };
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.app.served.name,
            "choices": [choice],
        })
    }

    /// OpenAI's `logprobs` of `items`: chat's `content` list, or completions' parallel lists
    /// with each token's character offset, counted on from `offset` (the text before them).
    fn logprobs(&self, items: &[TokenLogprob], offset: &mut usize) -> Value {
        let tokenizer = &self.app.served.tokenizer;
        let piece = |id: u32| tokenizer.decode(&[id]);
        match self.endpoint {
            Endpoint::Chat => {
                let entry = |id: u32, logprob: f32| {
                    let token = piece(id);
                    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
                };
                let content: Vec<Value> = items
                    .iter()
                    .map(|l| {
                        let mut e = entry(l.token, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completions => {
                let tokens: Vec<String> = items.iter().map(|l| piece(l.token)).collect();
                let text_offset: Vec<usize> = tokens
                    .iter()
                    .map(|t| {
                        let at = *offset;
                        *offset += t.chars().count();
                        at
                    })
                    .collect();
                let top: Vec<Value> = items
                    .iter()
                    .map(|l| Value::Object(l.top.iter().map(|&(t, lp)| (piece(t), json!(lp))).collect()))
                    .collect();
                let token_logprobs: Vec<f32> = items.iter().map(|l| l.logprob).collect();
                json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
            }
        }
    }

    fn usage_chunk(&self, generations: &[Box<Generation>]) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.app.served.name,
            "choices": [], "usage": usage(generations),
        })
    }
}

fn finish_reason(g: &Generation, stopped: bool) -> &'static str {
    match (stopped, g.stop) {
        (false, StopReason::MaxTokens) => "length",
        _ => "stop",
    }
}

/// OpenAI's usage of the choices `generations` (one prompt, counted once), with what
/// speculation did under `speculative`, summed over the choices.
fn usage(generations: &[Box<Generation>]) -> Value {
    let sum = |f: fn(&crate::generate::Stats) -> usize| generations.iter().map(|g| f(&g.stats)).sum::<usize>();
    let prompt = generations.first().map_or(0, |g| g.stats.prompt_tokens);
    let cached = generations.iter().map(|g| g.stats.cached_prompt_tokens).max().unwrap_or(0);
    let (generated, drafted, accepted, rounds) =
        (sum(|s| s.generated_tokens), sum(|s| s.drafted), sum(|s| s.accepted), sum(|s| s.rounds));
    let errors: Vec<&String> = generations.iter().filter_map(|g| g.stats.drafter_error.as_ref()).collect();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
        "speculative": {
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "rounds": rounds,
            "target_forwards": sum(|s| s.target_forwards),
            "tokens_per_round": if rounds == 0 { 0.0 } else { (accepted + rounds) as f64 / rounds as f64 },
            "acceptance_rate": if drafted == 0 { 0.0 } else { accepted as f64 / drafted as f64 },
            "drafter_error": errors.first(),
        },
    })
}

fn reply_id(endpoint: Endpoint, number: u64) -> String {
    let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    format!("{prefix}-{:x}-{number}", now())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
