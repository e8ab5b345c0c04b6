//! `host serve` over HTTP: the OpenAI endpoints, streamed and not; requests batched together
//! each equal to their single run; stop strings; errors in OpenAI's shape; API keys; a full
//! queue; a client that leaves; SIGTERM finishing the requests in flight.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kernels::os::processes::{self, Signal};
use serde_json::{json, Value};

struct Server {
    child: Child,
    base: String,
}

impl Server {
    /// `host serve` on the demo target with prompt lookup, on a free port.
    fn start(extra: &[&str]) -> Server {
        Server::start_with(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-ngram.toml"), extra)
    }

    fn start_with(manifest: &Path, extra: &[&str]) -> Server {
        let child = Command::new(env!("CARGO_BIN_EXE_host"))
            .args(["serve", "--manifest", manifest.to_str().unwrap(), "--port", "0"])
            .args(extra)
            .env_remove("HOST_API_KEY")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Owned by a Server at once, so that a failure below still stops the process.
        let mut server = Server { child, base: String::new() };
        let mut stderr = BufReader::new(server.child.stderr.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "host serve exited before listening");
            if let Some(address) = line.trim().strip_prefix("listening on ") {
                server.base = address.to_owned();
                // Keep draining stderr so the server never blocks on it.
                std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
                return server;
            }
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` to `path`: (status, JSON body).
    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_with(path, &body.to_string(), None)
    }

    fn post_with(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
        let mut request = ureq::post(&self.url(path)).set("content-type", "application/json");
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        match request.send_string(body) {
            Ok(r) => (r.status(), r.into_json().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
            Err(e) => panic!("{path}: {e}"),
        }
    }

    fn get(&self, path: &str) -> String {
        ureq::get(&self.url(path)).call().unwrap().into_string().unwrap()
    }

    /// The value of a metric line starting with `name` (0 when absent).
    fn metric(&self, name: &str) -> f64 {
        self.get("/metrics")
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
            .unwrap_or(0.0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn completion(prompt: &str, max_tokens: u32, extra: Value) -> Value {
    let mut body = json!({"model": "kjv-gemma4", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The `data:` payloads of a server-sent event stream.
fn sse_events(body: impl Read) -> Vec<String> {
    BufReader::new(body)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
        .collect()
}

/// `host run`'s text for the same greedy request.
fn host_run(prompt: &str, max_tokens: u32, extra: &[&str]) -> String {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-ngram.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["run", "--manifest", manifest.to_str().unwrap(), "--prompt", prompt, "--json"])
        .args(extra)
        .args(["--max-tokens", &max_tokens.to_string(), "--temperature", "0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<Value>(&out.stdout).unwrap()["text"].as_str().unwrap().to_owned()
}

const PROMPTS: [&str; 6] = [
    "In the beginning",
    "And it came to pass after",
    "The word of the LORD came",
    "Now it came to pass, when",
    "And Abraham said",
    "Blessed is the man",
];

#[test]
fn completions_streamed_and_not_equal_host_run() {
    let server = Server::start(&[]);
    let expected = host_run(PROMPTS[0], 40, &[]);
    let (status, whole) = server.post("/v1/completions", &completion(PROMPTS[0], 40, json!({})));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["choices"][0]["text"], expected.as_str());
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 40);
    assert!(whole["usage"]["speculative"]["rounds"].as_u64().unwrap() > 0);

    let body = completion(PROMPTS[0], 40, json!({"stream": true, "stream_options": {"include_usage": true}}));
    let response = ureq::post(&server.url("/v1/completions")).send_json(body).unwrap();
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    let events = sse_events(response.into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, expected);
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, [&json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 40, "the last chunk carries the usage");
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));

    // Penalties and a logit bias: the server (speculating) gives `host run`'s text with the same.
    let controls = json!({"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3,
                          "repetition_context_size": 16, "logit_bias": {"0": -100, "5": 1.5}});
    let flags = [
        "--frequency-penalty=0.8",
        "--presence-penalty=0.4",
        "--repetition-penalty=1.3",
        "--repetition-context-size=16",
        "--logit-bias=0=-100,5=1.5",
    ];
    let penalized = host_run(PROMPTS[0], 40, &flags);
    assert_ne!(penalized, expected, "the penalties change the text");
    let (status, whole) = server.post("/v1/completions", &completion(PROMPTS[0], 40, controls));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["text"], penalized.as_str());
}

/// `host run`'s text for a request sampled at temperature 0.8 with `seed`.
fn host_run_sampled(prompt: &str, max_tokens: u32, seed: u64) -> String {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-ngram.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["run", "--manifest", manifest.to_str().unwrap(), "--prompt", prompt, "--json"])
        .args(["--max-tokens", &max_tokens.to_string(), "--temperature", "0.8", "--seed", &seed.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<Value>(&out.stdout).unwrap()["text"].as_str().unwrap().to_owned()
}

/// `n` choices: choice i is sampled with the seed `seed + i`, as `host run --seed` samples it,
/// streamed or not, each with its own usage.
#[test]
fn n_choices_each_equal_the_single_run_of_their_seed() {
    let server = Server::start(&[]);
    let expected: Vec<String> = (0..3).map(|i| host_run_sampled(PROMPTS[1], 24, 40 + i)).collect();
    assert!(expected[0] != expected[1] || expected[1] != expected[2], "the seeds give different texts");
    let body = completion(PROMPTS[1], 24, json!({"n": 3, "temperature": 0.8, "seed": 40}));
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    let texts: Vec<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, expected);
    let indices: Vec<u64> = choices.iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, [0, 1, 2]);
    assert!(choices.iter().all(|c| c["usage"]["completion_tokens"] == 24), "{whole}");
    // The later choices take the prompt's prefill from the prefix cache.
    let cached: Vec<u64> =
        choices.iter().map(|c| c["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()).collect();
    assert!(cached[1] > 0 && cached[2] > 0, "{cached:?}");
    assert_eq!(whole["usage"]["completion_tokens"], 72, "{whole}");

    let body = completion(PROMPTS[1], 24, json!({"n": 3, "temperature": 0.8, "seed": 40, "stream": true}));
    let response = ureq::post(&server.url("/v1/completions")).send_json(body).unwrap();
    let events = sse_events(response.into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut streamed = vec![String::new(); 3];
    for chunk in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(chunk).unwrap();
        let choice = &chunk["choices"][0];
        streamed[choice["index"].as_u64().unwrap() as usize].push_str(choice["text"].as_str().unwrap());
    }
    assert_eq!(streamed, expected);
}

/// Log-probabilities in OpenAI's shapes: completions' parallel lists, chat's `content` list;
/// streamed, the chunks' together equal the whole response's.
#[test]
fn logprobs_come_in_openais_shapes_streamed_and_not() {
    let server = Server::start(&[]);
    let (status, whole) = server.post("/v1/completions", &completion(PROMPTS[2], 12, json!({"logprobs": 2})));
    assert_eq!(status, 200, "{whole}");
    let l = &whole["choices"][0]["logprobs"];
    let values: Vec<f64> = l["token_logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(values.len(), 12, "{l}");
    assert_eq!(l["tokens"].as_array().unwrap().len(), 12);
    assert!(values.iter().all(|&v| v <= 0.0), "{l}");
    let top = l["top_logprobs"].as_array().unwrap();
    assert!(top.iter().all(|t| t.as_object().unwrap().len() == 2), "{l}");
    let offsets: Vec<u64> = l["text_offset"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(offsets[0] == 0 && offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");

    let body = completion(PROMPTS[2], 12, json!({"logprobs": 2, "stream": true}));
    let events = sse_events(ureq::post(&server.url("/v1/completions")).send_json(body).unwrap().into_reader());
    let mut streamed = Vec::new();
    for chunk in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(chunk).unwrap();
        if let Some(v) = chunk["choices"][0]["logprobs"]["token_logprobs"].as_array() {
            streamed.extend(v.iter().map(|v| v.as_f64().unwrap()));
        }
    }
    assert_eq!(streamed, values);

    let body = json!({"messages": [{"role": "user", "content": "Who made the heaven?"}], "max_tokens": 6,
                      "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let (status, chat) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{chat}");
    let content = chat["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "{chat}");
    for entry in content {
        let token = entry["token"].as_str().unwrap();
        let bytes: Vec<u8> = entry["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(bytes, token.as_bytes());
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        // Greedy: the token is the most likely.
        assert_eq!(top[0]["logprob"], entry["logprob"], "{entry}");
    }
}

#[test]
fn concurrent_requests_each_equal_their_single_run() {
    let server = Server::start(&["--max-batch", "4"]);
    // Greedy rows and seeded sampled rows, alone first, then all at once.
    let body = |i: usize| {
        let sampled = if i % 2 == 1 { json!({"temperature": 0.8, "seed": 100 + i}) } else { json!({}) };
        completion(PROMPTS[i], 24 + 4 * i as u32, sampled)
    };
    let alone: Vec<Value> = (0..PROMPTS.len()).map(|i| server.post("/v1/completions", &body(i)).1).collect();
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..PROMPTS.len())
            .map(|i| {
                let (server, body) = (&server, body(i));
                s.spawn(move || {
                    // Staggered, so that rows join a batch already running.
                    std::thread::sleep(Duration::from_millis(30 * i as u64));
                    server.post("/v1/completions", &body).1
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"], "request {i}");
        assert_eq!(a["usage"]["completion_tokens"], t["usage"]["completion_tokens"], "request {i}");
    }
    assert!(server.metric("host_batch_size") <= 4.0);
    assert_eq!(server.metric("host_requests_total{outcome=\"ok\"}"), 2.0 * PROMPTS.len() as f64);
    assert!(server.metric("host_drafted_tokens_total") > 0.0);
}

#[test]
fn a_stop_string_ends_the_text_and_is_not_emitted() {
    let server = Server::start(&[]);
    let (_, full) = server.post("/v1/completions", &completion(PROMPTS[1], 60, json!({})));
    let full = full["choices"][0]["text"].as_str().unwrap().to_owned();
    // A stop string from the middle of the greedy text, spanning whatever tokens it spans.
    let start = full.char_indices().nth(full.chars().count() / 2).unwrap().0;
    let stop: String = full[start..].chars().take(4).collect();
    let cut = &full[..full.find(&stop).unwrap()];
    let (status, stopped) = server.post("/v1/completions", &completion(PROMPTS[1], 60, json!({"stop": [stop]})));
    assert_eq!(status, 200);
    assert_eq!(stopped["choices"][0]["text"], cut);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    let body = completion(PROMPTS[1], 60, json!({"stop": stop, "stream": true}));
    let events = sse_events(ureq::post(&server.url("/v1/completions")).send_json(body).unwrap().into_reader());
    let text: String = events
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(text, cut);
}

#[test]
fn chat_uses_the_checkpoints_template_streamed_and_not() {
    let server = Server::start(&[]);
    let body = json!({
        "model": "kjv-gemma4",
        "messages": [{"role": "user", "content": "Who made the heaven and the earth?"}],
        "max_completion_tokens": 24,
        "temperature": 0,
    });
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    assert_eq!(
        content,
        host_run("Who made the heaven and the earth?", 24, &["--chat"]),
        "host run --chat renders alike"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = sse_events(ureq::post(&server.url("/v1/chat/completions")).send_json(streamed).unwrap().into_reader());
    let chunks: Vec<Value> =
        events.iter().filter(|e| e.as_str() != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, content);
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let server = Server::start(&[]);
    let check = |path: &str, body: &str, status: u16, param: Value, says: &str| {
        let (code, error) = server.post_with(path, body, None);
        assert_eq!(code, status, "{body}: {error}");
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    };
    let c = "/v1/completions";
    check(c, "{\"prompt\": \"x\"", 400, Value::Null, "not valid JSON");
    check(c, r#"{"prompt": "x", "tempreature": 0}"#, 422, json!("tempreature"), "unknown field `tempreature`");
    check(c, r#"{"prompt": "x", "temperature": "hot"}"#, 422, json!("temperature"), "temperature");
    check(c, r#"{"prompt": "x", "temperature": 3}"#, 422, json!("temperature"), "[0, 2]");
    check(c, r#"{"prompt": "x", "n": 17}"#, 422, json!("n"), "must be 1 to 16, got 17");
    check(c, r#"{"prompt": "x", "n": 0}"#, 422, json!("n"), "must be 1 to 16, got 0");
    check(c, r#"{"prompt": "x", "model": "gpt-4"}"#, 404, json!("model"), "kjv-gemma4");
    check(c, r#"{"prompt": [1, 2, 999999]}"#, 422, json!("prompt"), "outside the vocabulary");
    check(c, r#"{"prompt": "x", "max_tokens": 200000}"#, 422, json!("max_tokens"), "context");
    let long = format!("{{\"prompt\": [{}]}}", vec!["5"; 131_072].join(","));
    check(c, &long, 413, json!("prompt"), "context of 131072");
    check(c, r#"{"messages": [{"role": "user", "content": "x"}]}"#, 422, json!("messages"), "chat/completions");
    let chat = "/v1/chat/completions";
    check(chat, r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, 422, json!("messages[0].role"), "wizard");
    check(chat, r#"{"messages": []}"#, 422, json!("messages"), "at least one");
    check(c, r#"{"prompt": "x", "draft_tokens": 9}"#, 422, json!("draft_tokens"), "1 to the server's 4");
    check(c, "null", 422, Value::Null, "the body must be a JSON object");
    check(c, r#"{"prompt": "x", "logprobs": 21}"#, 422, json!("logprobs"), "from 0 to 20");
    check(c, r#"{"prompt": "x", "top_logprobs": 2}"#, 422, json!("top_logprobs"), "chat/completions");
    let ask = r#"{"role": "user", "content": "x"}"#;
    let chat_logprobs = format!(r#"{{"messages": [{ask}], "logprobs": 3}}"#);
    check("/v1/chat/completions", &chat_logprobs, 422, json!("logprobs"), "true or false");
    let chat_top = format!(r#"{{"messages": [{ask}], "top_logprobs": 3}}"#);
    check("/v1/chat/completions", &chat_top, 422, json!("top_logprobs"), "needs \"logprobs\": true");
    check(c, r#"{"prompt": "x", "frequency_penalty": 2.5}"#, 422, json!("frequency_penalty"), "-2 to 2, got 2.5");
    check(c, r#"{"prompt": "x", "repetition_penalty": 0}"#, 422, json!("repetition_penalty"), "above 0");
    check(c, r#"{"prompt": "x", "logit_bias": {"999999": 1}}"#, 422, json!("logit_bias"), "outside the vocabulary");
    check(c, r#"{"prompt": "x", "logit_bias": {"5": -101}}"#, 422, json!("logit_bias"), "-100 to 100, got -101");
    check(c, r#"{"prompt": "x", "logit_bias": {"five": 1}}"#, 422, json!("logit_bias"), "`five` is not a token id");
    check(c, r#"{"prompt": "x", "stop": 5}"#, 422, json!("stop"), "expected a string or a list of strings");
    let image = r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#;
    check(chat, image, 422, json!("messages[0].content"), "images are not supported");
    let long = format!(r#"{{"prompt": "x", "model": "{}"}}"#, "m".repeat(10_000));
    let (_, error) = server.post_with(c, &long, None);
    assert!(error["error"]["message"].as_str().unwrap().len() < 200, "{error}");
    assert!(server.metric("host_requests_total{outcome=\"rejected\"}") >= 13.0);

    // Errors made by the HTTP layers before any handler have the same shape.
    // Just past the 2 MiB limit: the whole body is sent before the server has read enough to
    // refuse it, so the answer is not lost to a reset connection.
    let huge = format!("{{\"prompt\": \"{}\"}}", "x".repeat((2 << 20) + 16));
    check(c, &huge, 413, Value::Null, "length limit");
    for (method, path, status) in [("GET", c, 405), ("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404)] {
        let error = match ureq::request(method, &server.url(path)).call() {
            Err(ureq::Error::Status(code, r)) => (code, r.into_json::<Value>().unwrap()),
            other => panic!("{method} {path}: {other:?}"),
        };
        assert_eq!(error.0, status, "{method} {path}: {:?}", error.1);
        assert!(error.1["error"]["message"].is_string() && error.1["error"]["type"].is_string(), "{:?}", error.1);
    }
}

#[test]
fn an_api_key_guards_everything_but_health() {
    let server = Server::start(&["--api-key", "sesame"]);
    let body = completion(PROMPTS[0], 4, json!({})).to_string();
    let (code, error) = server.post_with("/v1/completions", &body, None);
    assert_eq!((code, error["error"]["type"].as_str()), (401, Some("authentication_error")));
    assert_eq!(server.post_with("/v1/completions", &body, Some("wrong")).0, 401);
    assert_eq!(server.post_with("/v1/completions", &body, Some("sesame")).0, 200);
    assert!(ureq::get(&server.url("/v1/models")).call().is_err());
    let models: Value =
        ureq::get(&server.url("/v1/models")).set("authorization", "Bearer sesame").call().unwrap().into_json().unwrap();
    assert_eq!(models["data"][0]["id"], "kjv-gemma4");
    assert_eq!(server.get("/health"), r#"{"status":"ok"}"#);
    // The scheme is case-insensitive (RFC 9110).
    let lower = ureq::get(&server.url("/v1/models")).set("authorization", "bearer sesame").call();
    assert!(lower.is_ok(), "{lower:?}");
}

#[test]
fn a_port_in_use_is_refused_once_before_the_model_loads() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-ngram.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["serve", "--manifest", manifest.to_str().unwrap(), "--port", &port])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("cannot listen on 127.0.0.1:{port}: ")), "{err}");
    assert_eq!(err.matches("in use").count(), 1, "{err}");
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let server = Server::start(&["--max-batch", "1", "--max-queue", "1"]);
    let codes: Vec<(u16, Option<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let server = &server;
                s.spawn(move || {
                    let body = completion(PROMPTS[2], 64, json!({}));
                    match ureq::post(&server.url("/v1/completions")).send_json(body) {
                        Ok(r) => (r.status(), None),
                        Err(ureq::Error::Status(code, r)) => (code, r.header("retry-after").map(str::to_owned)),
                        Err(e) => panic!("{e}"),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(codes.iter().any(|c| c.0 == 200), "{codes:?}");
    let refused: Vec<_> = codes.iter().filter(|c| c.0 == 429).collect();
    assert!(!refused.is_empty(), "{codes:?}");
    assert!(refused.iter().all(|c| c.1.as_deref() == Some("1")), "{codes:?}");
}

/// Starts a long streamed completion, reads its first event and hangs up; returns once the
/// server has counted `cancelled` cancelled requests.
fn leave_mid_stream(server: &Server, prompt: &str, cancelled: f64) {
    let body = completion(prompt, 4000, json!({"stream": true}));
    let response = ureq::post(&server.url("/v1/completions")).send_json(body).unwrap();
    let mut reader = BufReader::new(response.into_reader());
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.metric("host_requests_total{outcome=\"cancelled\"}") < cancelled {
        assert!(Instant::now() < deadline, "the row was not cancelled:\n{}", server.get("/metrics"));
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_client_that_leaves_cancels_its_row() {
    let server = Server::start(&[]);
    leave_mid_stream(&server, PROMPTS[3], 1.0);
    assert_eq!(server.metric("host_batch_size"), 0.0);
    assert!(server.metric("host_generated_tokens_total") < 4000.0);
    // The server goes on serving.
    assert_eq!(server.post("/v1/completions", &completion(PROMPTS[0], 4, json!({}))).0, 200);
}

/// Rows that end by a disconnect free their target caches and drafter rows: MLX holds what it
/// held after a request that finished (the prefix cache, which keeps prompts on purpose, off).
#[test]
fn clients_that_leave_leave_no_memory_behind() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-dflash.toml");
    let server = Server::start_with(&manifest, &["--prefix-cache-mb", "0"]);
    let idle_memory = || {
        // Set by the engine after each round, so read it once the batch is empty.
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.metric("host_batch_size") != 0.0 {
            assert!(Instant::now() < deadline, "the batch did not empty");
            std::thread::sleep(Duration::from_millis(20));
        }
        server.metric("host_mlx_active_memory_bytes")
    };
    assert_eq!(server.post("/v1/completions", &completion(PROMPTS[0], 40, json!({}))).0, 200);
    let idle = idle_memory();
    assert!(idle > 1e6, "the weights alone are megabytes: {idle}");
    for (i, prompt) in PROMPTS[1..4].iter().enumerate() {
        leave_mid_stream(&server, prompt, i as f64 + 1.0);
        assert_eq!(idle_memory(), idle, "after {} disconnects", i + 1);
    }
    assert_eq!(server.post("/v1/completions", &completion(PROMPTS[0], 40, json!({}))).0, 200);
    assert_eq!(idle_memory(), idle, "after a request that finished");
}

#[test]
fn sigterm_finishes_the_requests_in_flight() {
    let mut server = Server::start(&[]);
    let url = server.url("/v1/completions");
    let request = std::thread::spawn(move || {
        ureq::post(&url).send_json(completion(PROMPTS[4], 120, json!({}))).unwrap().into_json::<Value>().unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(processes::send(server.child.id(), Signal::Terminate));
    let reply = request.join().unwrap();
    assert_eq!(reply["usage"]["completion_tokens"], 120);
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_prompt_extending_an_earlier_one_hits_the_prefix_cache() {
    let server = Server::start(&[]);
    let first = "And Abraham journeyed from thence toward the south country, and dwelled between Kadesh";
    let (_, a) = server.post("/v1/completions", &completion(first, 8, json!({})));
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let longer = format!("{first} and Shur, and sojourned in Gerar.");
    let (_, b) = server.post("/v1/completions", &completion(&longer, 8, json!({})));
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached + 1, a["usage"]["prompt_tokens"].as_u64().unwrap(), "all of the first prompt but its last token");
    assert_eq!(server.metric("host_prefix_cache_hits_total"), 1.0);
    assert!(server.metric("host_prefix_cache_bytes") > 0.0);

    let uncached = Server::start(&["--prefix-cache-mb", "0"]);
    let (_, c) = uncached.post("/v1/completions", &completion(&longer, 8, json!({})));
    assert_eq!(b["choices"][0]["text"], c["choices"][0]["text"]);
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[test]
fn the_manifest_server_section_sets_what_flags_do_not() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-ngram.toml");
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("m.toml");
    let text = std::fs::read_to_string(&demo)
        .unwrap()
        .replace("../models", demo.parent().unwrap().join("../models").to_str().unwrap());
    std::fs::write(&manifest, format!("{text}\n[server]\napi_key = \"from-manifest\"\nport = 1\n")).unwrap();
    // --port wins over the manifest's port 1; the manifest's key holds.
    let server = Server::start_with(&manifest, &[]);
    let body = completion(PROMPTS[0], 2, json!({})).to_string();
    assert_eq!(server.post_with("/v1/completions", &body, None).0, 401);
    assert_eq!(server.post_with("/v1/completions", &body, Some("from-manifest")).0, 200);

    std::fs::write(&manifest, format!("{text}\n[server]\nmax_batch = 0\n")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_host")).args(["manifest", "check"]).arg(&manifest).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("server.max_batch: must be 1 to 256, got 0"), "{stderr}");
}

#[test]
fn bench_serving_reports_each_concurrency_with_identical_outputs() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/demo-ngram.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--manifest", manifest.to_str().unwrap(), "--serving", "1,3", "--requests", "3"])
        .args(["--pairs", "1", "--max-tokens", "12", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["concurrency"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    for row in rows {
        assert_eq!(row["identical"], true, "{row}");
        assert!(row["plain_tokens_per_s"][0].as_f64().unwrap() > 0.0, "{row}");
    }
}

#[test]
fn a_failing_drafter_fails_no_request() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let plugin = root.join("target/fixtures/debug/libmisbehaving.so");
    assert!(plugin.exists(), "{} is missing: make fixtures", plugin.display());
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&plugin, dir.path().join("libmisbehaving.so")).unwrap();
    let manifest = dir.path().join("m.toml");
    let model = root.join("models/kjv-gemma4").canonicalize().unwrap();
    std::fs::write(
        &manifest,
        format!(
            "[target]\nmodel = {model:?}\n[drafter]\nkind = \"misbehaving\"\n[drafter.options]\nmode = \"panic-in-draft\"\n"
        ),
    )
    .unwrap();
    let server = Server::start_with(&manifest, &["--plugins-dir", dir.path().to_str().unwrap()]);
    let plain_manifest = dir.path().join("plain.toml");
    std::fs::write(&plain_manifest, format!("[target]\nmodel = {model:?}\n")).unwrap();
    let plain = Server::start_with(&plain_manifest, &[]);
    let replies: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let server = &server;
                s.spawn(move || server.post("/v1/completions", &completion(PROMPTS[i], 16, json!({}))))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (status, reply)) in replies.iter().enumerate() {
        assert_eq!(*status, 200, "{reply}");
        // It panics in draft, or, for a row joining a running batch, cannot capture its row.
        let error = reply["usage"]["speculative"]["drafter_error"].as_str().unwrap_or_default();
        assert!(error.contains("panic") || error.contains("capture"), "request {i}: {reply}");
        let (_, alone) = plain.post("/v1/completions", &completion(PROMPTS[i], 16, json!({})));
        assert_eq!(reply["choices"][0]["text"], alone["choices"][0]["text"], "request {i}");
    }
}
