//! `host run --prompts-file`: one request per JSON line, generated together as rows of one
//! batch when a drafter is set (one target forward per round for all rows), else one after
//! another. Results come back in input order, one per line; a bad line is reported with its
//! number and does not stop the others.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::generate::{check_request, generate, Request, Stats, StopReason};
use crate::run::{Overrides, RunError, RunOptions, Session};
use crate::speculative::generate_speculative_rows;

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
    Done { tokens: Vec<u32>, text: String, stop: StopReason, stats: Box<Stats> },
    Failed { error: String },
}

/// Generates every request of `jsonl` (blank lines skipped) with the session `options` open.
pub fn run_batch(options: &RunOptions, jsonl: &str, warn: impl FnMut(String)) -> Result<Vec<BatchResult>, RunError> {
    let session = Session::open(options, warn)?;
    let mut results = Vec::new();
    let mut pending: Vec<(usize, Request)> = Vec::new();
    for (index, text) in jsonl.lines().enumerate().filter(|(_, t)| !t.trim().is_empty()) {
        let line = index + 1;
        let parsed: Result<Line, String> = serde_json::from_str(text).map_err(|e| format!("not a request: {e}"));
        let id = parsed.as_ref().ok().and_then(|l| l.id.clone());
        match parsed.and_then(|l| request(&session, &options.overrides, l)) {
            Ok(request) => {
                pending.push((results.len(), request));
                results.push(BatchResult { line, id, outcome: Outcome::Failed { error: "not generated".into() } });
            }
            Err(error) => results.push(BatchResult { line, id, outcome: Outcome::Failed { error } }),
        }
    }
    let requests: Vec<Request> = pending.iter().map(|(_, r)| r.clone()).collect();
    let generations: Vec<Result<_, String>> = match session.drafter_for(requests.len()) {
        Some((drafter, config)) => {
            match generate_speculative_rows(&session.model, drafter, &requests, config, |_, _| {}) {
                Ok(all) => all.into_iter().map(Ok).collect(),
                Err(e) => requests.iter().map(|_| Err(e.to_string())).collect(),
            }
        }
        None => requests.iter().map(|r| generate(&session.model, r, |_| {}).map_err(|e| e.to_string())).collect(),
    };
    for ((slot, _), generation) in pending.into_iter().zip(generations) {
        results[slot].outcome = match generation {
            Ok(g) => Outcome::Done {
                text: session.tokenizer.decode(&g.tokens),
                tokens: g.tokens,
                stop: g.stop,
                stats: Box::new(g.stats),
            },
            Err(error) => Outcome::Failed { error },
        };
    }
    Ok(results)
}

/// The line's request: its fields over the command line's, over the manifest's.
fn request(session: &Session, base: &Overrides, line: Line) -> Result<Request, String> {
    if line.prompt.is_some() && line.prompt_ids.is_some() {
        return Err("give `prompt` or `prompt_ids`, not both".into());
    }
    if line.prompt.is_none() && line.prompt_ids.is_none() {
        return Err("no `prompt` or `prompt_ids`".into());
    }
    let overrides = Overrides {
        prompt: line.prompt,
        prompt_ids: line.prompt_ids,
        max_tokens: line.max_tokens.or(base.max_tokens),
        temperature: line.temperature.or(base.temperature),
        seed: line.seed.or(base.seed),
        ..base.clone()
    };
    let request = session.request(&overrides).map_err(|e| e.to_string())?;
    check_request(&session.model, &request).map_err(|e| e.to_string())?;
    Ok(request)
}
