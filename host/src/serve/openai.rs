//! The OpenAI request bodies this server accepts, checked into a [`Request`], and the errors
//! it answers with (OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::engine::Ready;
use crate::chat::{ChatTemplate, Message};
use crate::generate::Request;
use crate::sampling::{Penalties, MOST_TOP_LOGPROBS};
use crate::tokenizer::Tokenizer;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: param.map(str::to_owned) }
    }

    /// A value out of its range or not supported: 422, naming the field.
    pub fn field(param: &str, message: impl std::fmt::Display) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, Some(param), format!("{param}: {message}"))
    }

    pub fn body(&self) -> serde_json::Value {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// The body of `/v1/completions` and `/v1/chat/completions`. Unknown fields are refused, so a
/// parameter this server would ignore never passes silently.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Body {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<ChatMessage>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    n: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// Extension: tokens the drafter proposes per round, at most the server's own.
    draft_tokens: Option<u32>,
    /// Accepted and ignored, as OpenAI does.
    #[allow(dead_code)]
    user: Option<String>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    /// Extensions, as mlx-lm's server names them.
    repetition_penalty: Option<f32>,
    repetition_context_size: Option<usize>,
    /// Token id (as a string, OpenAI's form) → bias, −100 to 100.
    logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Chat: whether to report log-probabilities; completions: how many alternatives.
    logprobs: Option<serde_json::Value>,
    /// Chat: how many alternatives, with `logprobs: true`.
    top_logprobs: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    Batches(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessage {
    role: String,
    content: Content,
    #[allow(dead_code)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ContentPart {
    r#type: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// A checked request, ready for the engine.
#[derive(Debug)]
pub struct Prepared {
    pub request: Request,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub draft_tokens: Option<usize>,
    /// Choices to generate, each a row of its own with the seed `seed + i`.
    pub n: usize,
}

/// What checking a body needs: the model's name and limits, its tokenizer and chat template.
pub struct Served {
    pub name: String,
    pub ready: Ready,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
}

/// How many alternatives a request's log-probabilities report (`None`: none): chat's
/// `logprobs: true` with `top_logprobs`, completions' `logprobs` as a number.
fn logprobs_of(endpoint: Endpoint, logprobs: Option<&Value>, top: Option<u32>) -> Result<Option<usize>, ApiError> {
    let most = MOST_TOP_LOGPROBS as u64;
    let count = |field: &'static str, n: Option<u64>| match n {
        Some(n) if n <= most => Ok(n as usize),
        _ => Err(ApiError::field(field, format!("must be an integer from 0 to {most}"))),
    };
    match (endpoint, logprobs) {
        (Endpoint::Chat, None | Some(Value::Null | Value::Bool(false))) => match top {
            None => Ok(None),
            Some(_) => Err(ApiError::field("top_logprobs", "needs \"logprobs\": true")),
        },
        (Endpoint::Chat, Some(Value::Bool(true))) => Ok(Some(count("top_logprobs", Some(top.unwrap_or(0) as u64))?)),
        (Endpoint::Chat, Some(_)) => Err(ApiError::field("logprobs", "must be true or false")),
        (Endpoint::Completions, _) if top.is_some() => {
            Err(ApiError::field("top_logprobs", "belongs to /v1/chat/completions; send `logprobs: N` here"))
        }
        (Endpoint::Completions, None | Some(Value::Null)) => Ok(None),
        (Endpoint::Completions, Some(n)) => Ok(Some(count("logprobs", n.as_u64())?)),
    }
}

/// Stop strings per request, as OpenAI allows four; a few more cost nothing here.
const MAX_STOPS: usize = 16;
/// The most choices (`n`) one request may ask for: each is a row of the batch.
pub const MAX_CHOICES: u32 = 16;

/// Parses `bytes`: malformed JSON is 400, a wrong type, missing or unknown field is 422 naming it.
pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_data() {
            let param = if path == "." { None } else { Some(path.as_str()) };
            let at = param.map(|p| format!("{p}: ")).unwrap_or_default();
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, param, format!("{at}{}", plain_words(&path, &inner)))
        } else {
            ApiError::new(StatusCode::BAD_REQUEST, None, format!("the body is not valid JSON: {inner}"))
        }
    })
}

/// `text` cut to 64 characters, for echoing what a client sent.
fn shortened(text: &str) -> String {
    match text.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// serde's message for `inner` at `path`, with the names of this module's types (which a
/// client never sees) replaced by what the field takes.
fn plain_words(path: &str, inner: &serde_json::Error) -> String {
    let message = inner.to_string();
    let at = message.rfind(" at line ").map_or(String::new(), |i| message[i..].to_owned());
    if path == "." && message.contains("struct Body") {
        format!("the body must be a JSON object of the request's fields{at}")
    } else if message.contains("untagged enum Stop") {
        format!("expected a string or a list of strings{at}")
    } else if message.contains("untagged enum Content") {
        format!("expected a string or a list of text parts (`{{\"type\": \"text\", \"text\": …}}`; images are not supported){at}")
    } else {
        message
    }
}

impl Served {
    /// Checks `body` for `endpoint` and builds its request; `seed` is used when it gives none.
    pub fn prepare(&self, endpoint: Endpoint, body: Body, seed: u64) -> Result<Prepared, ApiError> {
        if let Some(model) = &body.model {
            if model != &self.name {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    Some("model"),
                    format!("model `{}` is not served here (GET /v1/models lists `{}`)", shortened(model), self.name),
                ));
            }
        }
        let n = body.n.unwrap_or(1);
        if !(1..=MAX_CHOICES).contains(&n) {
            return Err(ApiError::field("n", format!("must be 1 to {MAX_CHOICES}, got {n}")));
        }
        let logprobs = logprobs_of(endpoint, body.logprobs.as_ref(), body.top_logprobs)?;
        if body.stream_options.is_some() && !body.stream {
            return Err(ApiError::field("stream_options", "is only allowed with \"stream\": true"));
        }
        let (field, prompt) = match endpoint {
            Endpoint::Completions => {
                if body.messages.is_some() {
                    return Err(ApiError::field("messages", "belongs to /v1/chat/completions; send `prompt` here"));
                }
                ("prompt", self.completion_prompt(body.prompt)?)
            }
            Endpoint::Chat => {
                if body.prompt.is_some() {
                    return Err(ApiError::field("prompt", "belongs to /v1/completions; send `messages` here"));
                }
                ("messages", self.chat_prompt(body.messages)?)
            }
        };
        let mut request = Request { prompt, logprobs, ..self.ready.defaults.clone() };
        if let Some(max) = body.max_completion_tokens.or(body.max_tokens) {
            let name = if body.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
            if max == 0 {
                return Err(ApiError::field(name, "must be at least 1"));
            }
            request.max_tokens = max as usize;
        }
        let context = self.ready.context;
        if request.prompt.len() >= context {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                Some(field),
                format!("{field}: {} tokens do not fit the model's context of {context} tokens", request.prompt.len()),
            ));
        }
        if request.prompt.len() + request.max_tokens > context {
            return Err(ApiError::field(
                "max_tokens",
                format!(
                    "the prompt's {} tokens plus {} exceed the model's context of {context} tokens",
                    request.prompt.len(),
                    request.max_tokens
                ),
            ));
        }
        let s = &mut request.sampling;
        if let Some(t) = body.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::field("temperature", format!("must be in [0, 2], got {t}")));
            }
            s.temperature = t;
        }
        if let Some(p) = body.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::field("top_p", format!("must be in (0, 1], got {p}")));
            }
            s.top_p = p;
        }
        if let Some(k) = body.top_k {
            // -1 and 0 both mean no limit, as vLLM reads them.
            s.top_k = u32::try_from(k.max(0)).map_err(|_| ApiError::field("top_k", format!("is too large: {k}")))?;
        }
        if let Some(p) = body.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(ApiError::field("min_p", format!("must be in [0, 1], got {p}")));
            }
            s.min_p = p;
        }
        s.seed = body.seed.unwrap_or(seed);
        let p = &mut request.penalties;
        p.frequency_penalty = body.frequency_penalty.unwrap_or(p.frequency_penalty);
        p.presence_penalty = body.presence_penalty.unwrap_or(p.presence_penalty);
        p.repetition_penalty = body.repetition_penalty.unwrap_or(p.repetition_penalty);
        p.repetition_context_size = body.repetition_context_size.unwrap_or(p.repetition_context_size);
        if let Some(bias) = &body.logit_bias {
            p.logit_bias = Penalties::parse_logit_bias(bias).map_err(|e| ApiError::field("logit_bias", e))?;
        }
        p.validate(self.ready.vocab as usize).map_err(|(field, why)| ApiError::field(field, why))?;
        let stops = match body.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stops.len() > MAX_STOPS {
            return Err(ApiError::field("stop", format!("at most {MAX_STOPS} strings, got {}", stops.len())));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::field("stop", "a stop string is empty"));
        }
        let draft_tokens = match (body.draft_tokens, self.ready.draft_tokens) {
            (None, _) => None,
            (Some(_), None) => return Err(ApiError::field("draft_tokens", "this server runs without a drafter")),
            (Some(n), Some(max)) if n == 0 || n as usize > max => {
                return Err(ApiError::field("draft_tokens", format!("must be 1 to the server's {max}, got {n}")))
            }
            (Some(n), Some(_)) => Some(n as usize),
        };
        Ok(Prepared {
            request,
            stops,
            stream: body.stream,
            include_usage: body.stream_options.is_some_and(|o| o.include_usage),
            draft_tokens,
            n: n as usize,
        })
    }

    fn completion_prompt(&self, prompt: Option<Prompt>) -> Result<Vec<u32>, ApiError> {
        let ids = match prompt {
            None => return Err(ApiError::field("prompt", "is required")),
            Some(Prompt::Text(text)) => self.encode(&text, "prompt", true)?,
            Some(Prompt::Ids(ids)) => ids,
            Some(Prompt::Texts(mut texts)) if texts.len() == 1 => self.encode(&texts.remove(0), "prompt", true)?,
            Some(Prompt::Batches(mut batches)) if batches.len() == 1 => batches.remove(0),
            Some(_) => return Err(ApiError::field("prompt", "one prompt per request (a list of one is accepted)")),
        };
        if ids.is_empty() {
            return Err(ApiError::field("prompt", "is empty"));
        }
        if let Some((at, id)) = ids.iter().enumerate().find(|(_, &id)| id >= self.ready.vocab) {
            return Err(ApiError::field(
                "prompt",
                format!("token id {id} (at position {at}) is outside the vocabulary of {}", self.ready.vocab),
            ));
        }
        Ok(ids)
    }

    fn chat_prompt(&self, messages: Option<Vec<ChatMessage>>) -> Result<Vec<u32>, ApiError> {
        let Some(messages) = messages.filter(|m| !m.is_empty()) else {
            return Err(ApiError::field("messages", "at least one message is required"));
        };
        let mut turns = Vec::with_capacity(messages.len());
        for (i, m) in messages.into_iter().enumerate() {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer") {
                return Err(ApiError::field(
                    &format!("messages[{i}].role"),
                    format!("`{}` is not one of system, developer, user, assistant", m.role),
                ));
            }
            let content = match m.content {
                Content::Text(text) => text,
                Content::Parts(parts) => {
                    let mut text = String::new();
                    for (j, part) in parts.into_iter().enumerate() {
                        match (part.r#type.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::field(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!("only text parts are supported, got `{kind}`"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            turns.push(Message { role: m.role, content });
        }
        let text = self.template.render(&turns).map_err(|e| ApiError::field("messages", e))?;
        self.encode(&text, "messages", false)
    }

    fn encode(&self, text: &str, field: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        let ids = if add_special { self.tokenizer.encode(text) } else { self.tokenizer.encode_rendered(text) };
        ids.map_err(|e| ApiError::field(field, e))
    }
}
