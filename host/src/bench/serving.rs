//! `host bench --serving`: what `host serve`'s engine delivers with several requests in flight.
//! A closed loop keeps `concurrency` requests in one continuously batched [`LiveBatch`] (a
//! finished request is replaced at once by the next); aggregate tokens/s is every generated
//! token over the wall time, prefills included. Each concurrency runs without and with the
//! drafter, paired and interleaved, and the outputs must be equal.

use std::rc::Rc;
use std::time::Instant;

use serde::Serialize;

use super::summary;
use crate::generate::{Event, Flow, GenerateError, Request};
use crate::model::Gemma4;
use crate::plugin::LoadedDrafter;
use crate::speculative::{LiveBatch, SpecConfig};

#[derive(Debug, Serialize)]
pub struct ServingRow {
    pub concurrency: usize,
    /// Aggregate tokens/s per run.
    pub plain_tokens_per_s: Vec<f64>,
    pub speculative_tokens_per_s: Vec<f64>,
    /// speculative / plain per pair.
    pub speedups: Vec<f64>,
    /// Tokens per target forward per row, over the last speculative run.
    pub tokens_per_round: f64,
    pub identical: bool,
}

#[derive(Debug, Serialize)]
pub struct ServingBench {
    pub kind: String,
    pub draft_tokens: usize,
    /// `draft_tokens = "auto"`: each round as deep as pays, up to `draft_tokens`.
    pub auto_draft_tokens: bool,
    pub requests: usize,
    pub max_tokens: usize,
    pub rows: Vec<ServingRow>,
}

/// `requests` run at each of `concurrencies`, `pairs` times without and with `drafter`.
pub fn serving(
    model: &Rc<Gemma4>,
    drafter: &LoadedDrafter,
    config: SpecConfig,
    requests: &[Request],
    concurrencies: &[usize],
    pairs: usize,
) -> Result<ServingBench, GenerateError> {
    let mut rows = Vec::new();
    for &concurrency in concurrencies {
        let run = |with: Option<&LoadedDrafter>| closed_loop(model, with, config, requests, concurrency);
        run(None)?;
        run(Some(drafter))?;
        let (mut plain, mut spec, mut identical, mut tau) = (Vec::new(), Vec::new(), true, 0.0);
        for pair in 0..pairs {
            let (p, s) = if pair % 2 == 0 {
                let p = run(None)?;
                (p, run(Some(drafter))?)
            } else {
                let s = run(Some(drafter))?;
                (run(None)?, s)
            };
            identical &= p.outputs == s.outputs;
            plain.push(p.tokens_per_s);
            spec.push(s.tokens_per_s);
            tau = s.tokens_per_round;
        }
        rows.push(ServingRow {
            concurrency,
            speedups: spec.iter().zip(&plain).map(|(s, p)| s / p).collect(),
            plain_tokens_per_s: plain,
            speculative_tokens_per_s: spec,
            tokens_per_round: tau,
            identical,
        });
    }
    Ok(ServingBench {
        kind: drafter.kind().to_owned(),
        draft_tokens: config.draft_tokens,
        auto_draft_tokens: config.auto,
        requests: requests.len(),
        max_tokens: requests.iter().map(|r| r.max_tokens).max().unwrap_or(0),
        rows,
    })
}

struct Run {
    tokens_per_s: f64,
    tokens_per_round: f64,
    outputs: Vec<Vec<u32>>,
}

fn closed_loop(
    model: &Rc<Gemma4>,
    drafter: Option<&LoadedDrafter>,
    config: SpecConfig,
    requests: &[Request],
    concurrency: usize,
) -> Result<Run, GenerateError> {
    let mut batch = LiveBatch::new(model, drafter, config)?;
    let mut outputs = vec![Vec::new(); requests.len()];
    let (mut next, mut tokens, mut rounds) = (0, 0, 0);
    let start = Instant::now();
    loop {
        while batch.len() < concurrency && next < requests.len() {
            batch.join(next, requests[next].clone(), |_| Flow::Continue)?;
            next += 1;
        }
        if batch.is_empty() {
            break;
        }
        for (i, g) in batch.round(|_, _: Event| Flow::Continue)? {
            tokens += g.tokens.len();
            rounds += g.stats.rounds;
            outputs[i] = g.tokens;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(Run { tokens_per_s: tokens as f64 / seconds, tokens_per_round: tokens as f64 / rounds.max(1) as f64, outputs })
}

impl ServingBench {
    pub fn text(&self) -> String {
        let drafting = crate::speculative::describe_draft_tokens(self.auto_draft_tokens, self.draft_tokens);
        let mut out = format!(
            "serving: {} requests of {} tokens per run, {} drafting {drafting} (median; speed-up range)\n\
             \x20 concurrency   plain tok/s   speculative tok/s   speed-up             tokens/round  identical\n",
            self.requests, self.max_tokens, self.kind
        );
        for r in &self.rows {
            let (p, _, _) = summary(&r.plain_tokens_per_s);
            let (s, _, _) = summary(&r.speculative_tokens_per_s);
            let (x, lo, hi) = summary(&r.speedups);
            out += &format!(
                "  {:>11}   {p:>11.1}   {s:>17.1}   {x:.2}x [{lo:.2}, {hi:.2}]   {:>12.2}  {}\n",
                r.concurrency, r.tokens_per_round, r.identical
            );
        }
        out
    }
}
