//! Plain decoding: prefill the prompt, then one target forward per token. EOS ends the
//! generation and is never part of it; `max_tokens` is exact.

use std::time::Instant;

use mlx_rs::Array;
use plugin_api::nn::layout;
use serde::Serialize;

use crate::model::{Gemma4, LayerCache, ModelError};
use crate::sampling::{
    draw_token, token_after, Drawn, Penalties, Prefix, SampleError, SamplingParams, TokenLogprob, MOST_TOP_LOGPROBS,
};

/// Prompt tokens per prefill forward.
pub const PREFILL_CHUNK: usize = 512;
/// Rows a sliding cache can roll back; plain decoding needs none, and a ring of exactly the
/// window lets decode steps attend without a mask.
const PLAIN_SLACK: usize = 0;

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Penalties and logit biases, applied to each position for the tokens before it.
    #[serde(default)]
    pub penalties: Penalties,
    /// Report each token's log-probability with this many alternatives ([`Event::Logprob`]).
    #[serde(default)]
    pub logprobs: Option<usize>,
    pub eos: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt token id {id} (at position {position}) is outside the vocabulary of {vocab}")]
    OutOfVocabulary { id: u32, position: usize, vocab: u32 },
    #[error(
        "the prompt's {prompt} tokens plus max_tokens {max_tokens} exceed the model's context of {context} \
         tokens (max_position_embeddings)"
    )]
    BeyondContext { prompt: usize, max_tokens: usize, context: usize },
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Drafter(crate::plugin::DrafterError),
    #[error(
        "the target's logits for output token {step} are NaN or infinite: its weights or activations \
         are broken (`host check-model DIR` scans the weights)"
    )]
    NonFiniteLogits { step: usize },
    #[error("internal error: {0}")]
    Internal(String),
}

impl GenerateError {
    /// A sampling failure at output token `step`.
    pub fn sampling_at(step: usize, error: SampleError) -> GenerateError {
        match error {
            SampleError::NonFinite => GenerateError::NonFiniteLogits { step },
            SampleError::Mlx(e) => e.into(),
        }
    }
}

impl From<mlx_rs::error::Exception> for GenerateError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        GenerateError::Model(ModelError::Mlx(e))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    MaxTokens,
    /// The caller asked to stop (Ctrl-C, a closed pipe, a cancelled request).
    Interrupted,
}

/// What a generation reports as it works.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// `done` of the prompt's `total` tokens are through the target.
    Prefill { done: usize, total: usize },
    /// The next output token.
    Token(u32),
    /// The log-probabilities of the token that follows at once, when the request asks for them.
    Logprob(TokenLogprob),
}

/// The caller's answer to an [`Event`]: go on, or stop with what was produced so far
/// ([`StopReason::Interrupted`]). A callback returning `()` always goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

impl From<()> for Flow {
    fn from(_: ()) -> Flow {
        Flow::Continue
    }
}

/// What a generation did; the keys of `host run --json`'s "stats".
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose prefill was reused from an earlier prompt (`host serve`'s prefix cache).
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub rounds: usize,
    pub target_forwards: usize,
    pub mean_accept_len: f64,
    pub acceptance_rate: f64,
    pub accepted_by_position: Vec<f64>,
    /// Rounds that drafted each position (what `accepted_by_position` is a share of).
    pub drafted_by_position: Vec<usize>,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// Of `decode_ms`, the time spent in the drafter's calls during rounds (drafting, and taking
    /// in what the target accepted); with several rows in a batch, each row counts the whole
    /// round it shared. Drafts left on the device are computed with the verify forward, so
    /// their computing counts in `verify_ms`.
    pub draft_ms: f64,
    /// Of `decode_ms`, the time of the target's verify forwards with their sampling and
    /// acceptance.
    pub verify_ms: f64,
    /// Why the drafter was dropped mid-request, if it was; the rest was decoded plainly.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafter_error: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub stats: Stats,
    /// Per token, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
}

pub fn check_request(model: &Gemma4, request: &Request) -> Result<(), GenerateError> {
    if request.prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let vocab = model.config.vocab_size as u32;
    if let Some((position, &id)) = request.prompt.iter().enumerate().find(|(_, &id)| id >= vocab) {
        return Err(GenerateError::OutOfVocabulary { id, position, vocab });
    }
    let context = model.config.max_position_embeddings;
    if request.prompt.len().saturating_add(request.max_tokens) > context {
        return Err(GenerateError::BeyondContext {
            prompt: request.prompt.len(),
            max_tokens: request.max_tokens,
            context,
        });
    }
    request.sampling.validate().map_err(GenerateError::Sampling)?;
    request
        .penalties
        .validate(vocab as usize)
        .map_err(|(field, why)| GenerateError::Sampling(format!("{field}: {why}")))?;
    match request.logprobs {
        Some(n) if n > MOST_TOP_LOGPROBS => {
            Err(GenerateError::Sampling(format!("logprobs: at most {MOST_TOP_LOGPROBS} alternatives, got {n}")))
        }
        _ => Ok(()),
    }
}

/// One row of token ids as the model takes them: [1, L] int32.
pub fn token_ids(tokens: &[u32]) -> Array {
    Array::from_slice(&tokens.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, tokens.len() as i32])
}

/// Decodes plainly, telling `on_event` of the prefill's progress and of each token as it is
/// produced; it may answer [`Flow::Stop`].
pub fn generate<R: Into<Flow>>(
    model: &Gemma4,
    request: &Request,
    mut on_event: impl FnMut(Event) -> R,
) -> Result<Generation, GenerateError> {
    check_request(model, request)?;
    let mut stats = Stats { prompt_tokens: request.prompt.len(), ..Stats::default() };
    let mut caches = model.make_caches(1, PLAIN_SLACK);
    let mut tokens = Vec::new();

    let started = Instant::now();
    let mut logits = None;
    let mut done = 0;
    for chunk in request.prompt.chunks(PREFILL_CHUNK) {
        let ids = token_ids(chunk);
        let hidden = model.forward_hidden(&ids, &mut caches, None)?;
        stats.target_forwards += 1;
        let chunk_logits = last_logits(model, &hidden)?;
        // MLX is lazy: each chunk is computed here, inside the prefill's time.
        chunk_logits.eval()?;
        logits = Some(chunk_logits);
        done += chunk.len();
        if on_event(Event::Prefill { done, total: request.prompt.len() }).into() == Flow::Stop {
            stats.prefill_ms = ms(started);
            return Ok(Generation { tokens, stop: StopReason::Interrupted, stats, logprobs: Vec::new() });
        }
    }
    let logits = logits.expect("a non-empty prompt has a chunk");
    stats.prefill_ms = ms(started);

    let decoding = Instant::now();
    let mut logprobs = Vec::new();
    let (mut drawn, mut logprob) = choose(&logits, request, &tokens, 0)?;
    drawn.queue()?;
    let stop = loop {
        let step = tokens.len();
        // On a device, the next step is built from this token while it is still being computed
        // and queued before the host reads it, as mlx-lm does: the device never waits for the
        // host between steps. Past an end it computes one step that is dropped.
        // (A token chosen on the host, for penalties or log-probabilities, is read already.)
        let ahead = match drawn.on_device() && step + 1 < request.max_tokens {
            true => Some(decode_step(model, &drawn, &mut caches, request, &tokens, step + 1)?),
            false => None,
        };
        let next = drawn.read().map_err(|e| GenerateError::sampling_at(step, e))?;
        if request.eos.contains(&next) {
            break StopReason::Eos;
        }
        if tokens.len() == request.max_tokens {
            break StopReason::MaxTokens;
        }
        tokens.push(next);
        if let Some(l) = logprob.take() {
            logprobs.push(l.clone());
            on_event(Event::Logprob(l));
        }
        let flow = on_event(Event::Token(next)).into();
        if tokens.len() == request.max_tokens {
            break StopReason::MaxTokens;
        }
        if flow == Flow::Stop {
            break StopReason::Interrupted;
        }
        (drawn, logprob) = match ahead {
            Some(ahead) => ahead,
            None => decode_step(model, &drawn, &mut caches, request, &tokens, step + 1)?,
        };
        // Counted once used: a step queued past an end is not.
        stats.target_forwards += 1;
    };
    stats.decode_ms = ms(decoding);
    stats.generated_tokens = tokens.len();
    stats.rounds = tokens.len();
    stats.mean_accept_len = if tokens.is_empty() { 0.0 } else { 1.0 };
    stats.prefill_tokens_per_s = per_second(request.prompt.len(), stats.prefill_ms);
    // The first token comes from the prefill; decode time covers the rest.
    stats.decode_tokens_per_s = per_second(tokens.len().saturating_sub(1), stats.decode_ms);
    Ok(Generation { tokens, stop, stats, logprobs })
}

/// One decode step: the target over `input`'s token, and the token of output position `step`
/// (after `generated`) chosen from its logits, queued.
fn decode_step(
    model: &Gemma4,
    input: &Drawn,
    caches: &mut [LayerCache],
    request: &Request,
    generated: &[u32],
    step: usize,
) -> Result<(Drawn, Option<TokenLogprob>), GenerateError> {
    let hidden = model.forward_hidden(&input.ids()?, caches, None)?;
    let logits = last_logits(model, &hidden)?;
    let chosen = choose(&logits, request, generated, step)?;
    chosen.0.queue()?;
    Ok(chosen)
}

/// The token of output position `step` from its logits: by [`draw_token`], or on the host
/// after the prompt and the `generated` tokens (penalties, log-probabilities).
fn choose(
    logits: &Array,
    request: &Request,
    generated: &[u32],
    step: usize,
) -> Result<(Drawn, Option<TokenLogprob>), GenerateError> {
    let prefix = request.prefix(generated);
    let chosen = match prefix.on_host() {
        true => token_after(logits, &request.sampling, &prefix, step as u64).map(|(t, l)| (Drawn::Read(t), l)),
        false => draw_token(logits, &request.sampling, step as u64).map(|d| (d, None)),
    };
    chosen.map_err(|e| GenerateError::sampling_at(step, e))
}

impl Request {
    /// Whether its tokens are chosen on the host from the logits (penalties, log-probabilities).
    pub fn chosen_on_host(&self) -> bool {
        self.prefix(&[]).on_host()
    }

    /// What choosing the token after the prompt and `generated` needs besides the logits.
    pub fn prefix<'a>(&'a self, generated: &'a [u32]) -> Prefix<'a> {
        Prefix { prompt: &self.prompt, generated, penalties: &self.penalties, logprobs: self.logprobs }
    }
}

/// Logits [1, V] of the last position of hidden [1, L, H], cut on the host (an MLX op would
/// cost a round trip to MLX's thread every token).
pub fn last_logits(model: &Gemma4, hidden: &Array) -> Result<Array, mlx_rs::error::Exception> {
    let s: Vec<usize> = hidden.shape().iter().map(|&d| d as usize).collect();
    let last = layout::slice(hidden, &[0..s[0], s[1] - 1..s[1], 0..s[2]])?;
    model.logits_from_hidden(&layout::reshape(&last, &[s[0] as i32, s[2] as i32])?)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn per_second(tokens: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        tokens as f64 / (ms / 1e3)
    } else {
        0.0
    }
}
