//! `host run --prompts-file`: one request per JSON line, generated together as rows of one
//! batch when a drafter is set (one target forward per round for all rows), else one after
//! another. Results are written in input order, one per line, each as soon as it and the lines
//! before it are done, so that nothing finished is lost; a bad line is reported with its number
//! and does not stop the others.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::generate::{check_request, generate, Flow, GenerateError, Generation, Request, Stats, StopReason};
use crate::run::{Overrides, RunError, RunOptions, Session};
use crate::sampling::{Penalties, TokenLogprob};
use crate::speculative::LiveBatch;

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("writing a result: {0}")]
    Write(#[from] std::io::Error),
}

/// One line of the prompts file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    id: Option<Value>,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    seed: Option<u64>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    repetition_context_size: Option<usize>,
    /// Token id (as a string, as in JSON requests) → bias.
    logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    logprobs: Option<usize>,
}

/// The result of one line, as `--output` writes it.
#[derive(Debug, Serialize)]
pub struct BatchResult {
    /// 1-based line number in the prompts file.
    pub line: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<Value>,
    #[serde(flatten)]
    pub outcome: Outcome,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Outcome {
    Done {
        tokens: Vec<u32>,
        text: String,
        stop: StopReason,
        stats: Box<Stats>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        logprobs: Vec<TokenLogprob>,
    },
    Failed {
        error: String,
    },
}

/// Results in input order, each handed on as soon as it and every line before it are known.
struct InOrder<F> {
    results: Vec<Option<BatchResult>>,
    next: usize,
    emit: F,
}

impl<F: FnMut(BatchResult) -> std::io::Result<()>> InOrder<F> {
    fn set(&mut self, slot: usize, result: BatchResult) -> std::io::Result<()> {
        self.results[slot] = Some(result);
        while let Some(result) = self.results.get_mut(self.next).and_then(Option::take) {
            (self.emit)(result)?;
            self.next += 1;
        }
        Ok(())
    }
}

/// How many results [`run_batch`] handed on, and how many of them are errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub results: usize,
    pub failed: usize,
}

/// Generates every request of `jsonl` (blank lines skipped) with the session `options` open,
/// handing each result to `emit` in input order as soon as it and the lines before it are done.
/// Once `stop` says so, each row in flight ends at its next token (`"stop": "interrupted"`)
/// and requests not started are reported as not generated.
pub fn run_batch(
    options: &RunOptions,
    jsonl: &str,
    warn: impl FnMut(String),
    stop: impl Fn() -> bool,
    emit: impl FnMut(BatchResult) -> std::io::Result<()>,
) -> Result<Counts, BatchError> {
    let session = Session::open(options, warn)?;
    let mut ids = Vec::new();
    let mut pending: Vec<(usize, Request)> = Vec::new();
    let mut early = Vec::new();
    for (index, text) in jsonl.lines().enumerate().filter(|(_, t)| !t.trim().is_empty()) {
        let line = index + 1;
        let parsed: Result<Line, String> = match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(_)) => serde_json::from_str(text).map_err(|e| format!("not a request: {e}")),
            Ok(_) => Err("not a request: expected a JSON object with `prompt` or `prompt_ids`".into()),
            Err(e) => Err(format!("not a request: not valid JSON: {e}")),
        };
        let id = parsed.as_ref().ok().and_then(|l| l.id.clone());
        match parsed.and_then(|l| request(&session, &options.overrides, l)) {
            Ok(request) => pending.push((ids.len(), request)),
            Err(error) => early.push((ids.len(), error)),
        }
        ids.push((line, id));
    }
    let mut out = InOrder { results: (0..ids.len()).map(|_| None).collect(), next: 0, emit };
    let mut finish = |slot: usize, outcome: Outcome| {
        let (line, id) = ids[slot].clone();
        let failed = matches!(outcome, Outcome::Failed { .. });
        out.set(slot, BatchResult { line, id, outcome }).map(|()| failed as usize)
    };
    let mut failed = 0;
    for (slot, error) in early {
        failed += finish(slot, Outcome::Failed { error })?;
    }
    let done = |g: Generation| Outcome::Done {
        text: session.tokenizer.decode(&g.tokens),
        tokens: g.tokens,
        stop: g.stop,
        stats: Box::new(g.stats),
        logprobs: g.logprobs,
    };
    let flow = || if stop() { Flow::Stop } else { Flow::Continue };
    let mut finish = |slot: usize, outcome: Result<Generation, String>| {
        finish(slot, outcome.map_or_else(|error| Outcome::Failed { error }, done)).map(|f| failed += f)
    };
    match session.speculation() {
        Some((drafter, config)) => {
            let batch = LiveBatch::new(&session.model, Some(drafter), config);
            as_rows(batch, &pending, flow, &mut finish)?
        }
        None => {
            for (slot, request) in &pending {
                let generation = if stop() {
                    Err("not generated: interrupted".to_owned())
                } else {
                    generate(&session.model, request, |_| flow()).map_err(|e| e.to_string())
                };
                finish(*slot, generation)?;
            }
        }
    }
    Ok(Counts { results: ids.len(), failed })
}

/// The `pending` requests as rows of one speculative batch, each finished as it leaves it; a
/// batch that cannot go on fails every row still in it with the reason.
fn as_rows(
    batch: Result<LiveBatch<'_, usize>, GenerateError>,
    pending: &[(usize, Request)],
    flow: impl Fn() -> Flow,
    finish: &mut impl FnMut(usize, Result<Generation, String>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut open: Vec<usize> = pending.iter().map(|(slot, _)| *slot).collect();
    let joined = batch.and_then(|mut batch| {
        for (slot, request) in pending {
            batch.join(*slot, request.clone(), |_| flow())?;
        }
        Ok(batch)
    });
    let error = match joined {
        Err(e) => e,
        Ok(mut batch) => loop {
            if batch.is_empty() {
                return Ok(());
            }
            match batch.round(|_, _| flow()) {
                Ok(finished) => {
                    for (slot, generation) in finished {
                        open.retain(|&s| s != slot);
                        finish(slot, Ok(generation))?;
                    }
                }
                Err(e) => break e,
            }
        },
    };
    for slot in open {
        finish(slot, Err(error.to_string()))?;
    }
    Ok(())
}

/// The line's request: its fields over the command line's, over the manifest's.
fn request(session: &Session, base: &Overrides, line: Line) -> Result<Request, String> {
    if line.prompt.is_some() && line.prompt_ids.is_some() {
        return Err("give `prompt` or `prompt_ids`, not both".into());
    }
    if line.prompt.is_none() && line.prompt_ids.is_none() {
        return Err("no `prompt` or `prompt_ids`".into());
    }
    let logit_bias = match &line.logit_bias {
        Some(bias) => Some(Penalties::parse_logit_bias(bias).map_err(|e| format!("logit_bias: {e}"))?),
        None => base.logit_bias.clone(),
    };
    let overrides = Overrides {
        prompt: line.prompt,
        prompt_ids: line.prompt_ids,
        max_tokens: line.max_tokens.or(base.max_tokens),
        temperature: line.temperature.or(base.temperature),
        seed: line.seed.or(base.seed),
        frequency_penalty: line.frequency_penalty.or(base.frequency_penalty),
        presence_penalty: line.presence_penalty.or(base.presence_penalty),
        repetition_penalty: line.repetition_penalty.or(base.repetition_penalty),
        repetition_context_size: line.repetition_context_size.or(base.repetition_context_size),
        logit_bias,
        logprobs: line.logprobs.or(base.logprobs),
        ..base.clone()
    };
    let request = session.request(&overrides).map_err(|e| e.to_string())?;
    check_request(&session.model, &request).map_err(|e| e.to_string())?;
    Ok(request)
}
