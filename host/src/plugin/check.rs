//! `host plugins check LIBRARY`: a built drafter library, loaded as `run` loads it, put through
//! its paces on a real target before anyone trusts it. Every check says what it ran and, where it
//! failed, which request, row and call; the library passes only when every check holds.
//!
//! The checks: the library loads; the conformance kit's contract checks pass through its ABI (on
//! a synthetic target of the real one's sizes); it opens on the target; greedy speculative output equals plain
//! decoding on every prompt at several draft lengths, past the target's sliding window; seeded
//! sampled output equals plain sampling; rows sharing rounds (at 1 and 6 draft tokens), and
//! rows joining and leaving mid-flight, each equal their plain runs; a prompt extending a cached
//! one starts from the cached row states. A drafter dropped mid-request (a panic, ids outside the
//! vocabulary, too many tokens) fails the check it was dropped in, with the host's reason.
//! Then a short measurement: tokens per target forward, acceptance by position, time per round.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use serde::Serialize;

use super::load::load;
use super::LoadedDrafter;
use crate::generate::{generate, Event, Flow, Generation, Request, StopReason};
use crate::model::Gemma4;
use crate::sampling::SamplingParams;
use crate::speculative::{generate_speculative, generate_speculative_rows, probe_open, LiveBatch, SpecConfig, Verify};

/// Draft lengths every greedy prompt is checked at.
pub const DRAFT_LENGTHS: [usize; 3] = [1, 3, 6];

/// One check and how it went.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub check: String,
    pub passed: bool,
    /// Why it failed, or what it covered.
    pub detail: String,
}

/// What the drafter bought on the check's greedy runs at 3 draft tokens.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// Generated tokens per target forward (τ).
    pub tokens_per_forward: f64,
    pub accepted_by_position: Vec<f64>,
    pub draft_ms_per_round: f64,
    pub verify_ms_per_round: f64,
    /// Plain decoding's time over speculative decoding's.
    pub speedup: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub library: PathBuf,
    pub kind: Option<String>,
    pub checks: Vec<Outcome>,
    pub measurement: Option<Measurement>,
}

impl Report {
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }

    pub fn text(&self) -> String {
        let mut out = format!("checking {}\n", self.library.display());
        for c in &self.checks {
            out.push_str(&format!("  {} {}: {}\n", if c.passed { "ok  " } else { "FAIL" }, c.check, c.detail));
        }
        if let Some(m) = &self.measurement {
            let positions: Vec<String> = m.accepted_by_position.iter().map(|a| format!("{a:.2}")).collect();
            out.push_str(&format!(
                "  {:.2} tokens per target forward, accepted by position [{}], a round {:.2} ms drafting and \
                 {:.2} ms verifying, {:.2}x plain speed\n",
                m.tokens_per_forward,
                positions.join(", "),
                m.draft_ms_per_round,
                m.verify_ms_per_round,
                m.speedup
            ));
        }
        let failed = self.checks.iter().filter(|c| !c.passed).count();
        out.push_str(&match failed {
            0 => format!("passed: {} checks\n", self.checks.len()),
            n => format!("FAILED: {n} of {} checks\n", self.checks.len()),
        });
        out
    }
}

/// What to check the library against.
pub struct Setup<'a> {
    pub library: &'a Path,
    pub model: &'a Rc<Gemma4>,
    pub artifact: Option<&'a Path>,
    /// The `[drafter.options]` to load it with, as TOML.
    pub options: &'a str,
    pub prompts: &'a [Vec<u32>],
    /// Tokens each request generates.
    pub max_tokens: usize,
}

/// Runs every check, stopping where the library does not load, takes an artifact other than
/// as given, or does not open on the target.
pub fn check(setup: &Setup) -> Report {
    let mut report = Report { library: setup.library.to_owned(), kind: None, checks: Vec::new(), measurement: None };
    let mut note = |check: &str, result: Result<String, String>| {
        let passed = result.is_ok();
        let detail = result.unwrap_or_else(|e| e);
        report.checks.push(Outcome { check: check.to_owned(), passed, detail });
        passed
    };
    let plugin = match load(setup.library, None) {
        Ok(plugin) => plugin,
        Err(e) => {
            note("load", Err(e.to_string()));
            return report;
        }
    };
    let kind = plugin.descriptor.kind.to_string();
    note("load", Ok(format!("kind `{kind}`, plugin API {}", plugin.api_version)));
    // What a manifest would be refused for, refused here too.
    let artifact = match crate::plugin::check_artifact(&plugin.descriptor, setup.artifact) {
        Ok(()) => Ok(setup.artifact.map_or("none".to_owned(), |dir| dir.display().to_string())),
        Err(why) if setup.artifact.is_none() => Err(format!("{why}: name it with --artifact DIR")),
        Err(why) => Err(why),
    };
    if !note("artifact", artifact) {
        report.kind = Some(kind);
        return report;
    }
    // The conformance kit through the library's own ABI, on a synthetic target of the real
    // one's shape.
    let contract = plugin_api::conformance::check_root(plugin.root, &conformance_config(setup));
    for (name, outcome) in contract.checks {
        note(&format!("contract: {name}"), outcome.map(|()| "holds".to_owned()));
    }
    let drafter = LoadedDrafter::load(&plugin, setup.artifact, setup.options)
        .map_err(|e| e.to_string())
        .and_then(|d| probe_open(setup.model, &d).map(|()| d).map_err(|e| e.to_string()));
    let opened = match &drafter {
        Ok(d) => Ok(format!("artifact {}, opened on the target", d.info.id)),
        Err(e) => Err(e.clone()),
    };
    let opened_ok = note("open", opened);
    let (Ok(drafter), true) = (drafter, opened_ok) else {
        report.kind = Some(kind);
        return report;
    };

    let request = |prompt: &Vec<u32>, sampling: SamplingParams| Request {
        prompt: prompt.clone(),
        max_tokens: setup.max_tokens,
        sampling,
        ..Request::default()
    };
    let greedy = SamplingParams::default();
    let sampled = |seed| SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..SamplingParams::default() };
    let plain = PlainRuns { model: setup.model, runs: RefCell::new(HashMap::new()) };
    let mut measured = Vec::new();
    for &gamma in &DRAFT_LENGTHS {
        for (p, prompt) in setup.prompts.iter().enumerate() {
            let r = request(prompt, greedy);
            let result = one_request(&plain, &drafter, &r, gamma);
            if gamma == 3 {
                if let Ok((spec, plain)) = &result {
                    measured.push((spec.stats.clone(), plain.stats.decode_ms));
                }
            }
            note(&format!("greedy, {gamma} draft tokens, prompt {p}"), result.map(|(spec, _)| summary(&spec)));
        }
    }
    for (p, prompt) in setup.prompts.iter().enumerate() {
        let r = request(prompt, sampled(7 + p as u64));
        let result = one_request(&plain, &drafter, &r, 3).map(|(spec, _)| summary(&spec));
        note(&format!("sampled (T 0.8, top-p 0.95, seed {}), 3 draft tokens, prompt {p}", 7 + p), result);
    }
    let requests: Vec<Request> = setup
        .prompts
        .iter()
        .enumerate()
        .map(|(p, prompt)| request(prompt, if p % 2 == 0 { greedy } else { sampled(20 + p as u64) }))
        .collect();
    for gamma in [1, 6] {
        let check = format!("{} rows in one batch, {gamma} draft tokens", requests.len());
        note(&check, batch(&plain, &drafter, &requests, gamma));
    }
    note("rows joining and leaving a batch mid-flight", rows_in_flight(&plain, &drafter, &requests));
    let mut longer = setup.prompts[0].clone();
    longer.extend(setup.prompts.last().expect("a prompt").iter().take(16));
    let (first, second) = (request(&setup.prompts[0], greedy), request(&longer, greedy));
    note(
        "a prompt extending a cached one (row state captured, then restored)",
        prefix_cache(&plain, &drafter, &first, &second),
    );

    report.kind = Some(kind);
    report.measurement = measure(&measured);
    report
}

/// The conformance kit's setup: the drafter's artifact and options, and a synthetic target of the
/// real target's sizes.
fn conformance_config(setup: &Setup) -> plugin_api::conformance::Config {
    let c = &setup.model.config;
    plugin_api::conformance::Config {
        artifact: setup.artifact.map(Path::to_owned),
        options: setup.options.to_owned(),
        vocab_size: c.vocab_size as u32,
        hidden_size: c.hidden_size as u32,
        num_layers: c.num_hidden_layers as u32,
        final_logit_softcap: c.final_logit_softcapping.unwrap_or(0.0),
        head_dim: c.head_dim as u32,
        global_head_dim: c.global_head_dim as u32,
        sliding_window: c.sliding_window as u32,
        ..plugin_api::conformance::Config::default()
    }
}

/// A request speculatively at `gamma` draft tokens and plainly: equal tokens, and the drafter
/// never dropped.
fn one_request(
    plain: &PlainRuns,
    drafter: &LoadedDrafter,
    request: &Request,
    gamma: usize,
) -> Result<(Generation, Generation), String> {
    let config = SpecConfig::new(gamma, Verify::Match);
    let spec =
        generate_speculative(plain.model, drafter, request, config, |_| Flow::Continue).map_err(|e| e.to_string())?;
    let plain = plain.of(request)?;
    if let Some(error) = &spec.stats.drafter_error {
        return Err(format!("the host dropped the drafter: {error}"));
    }
    compare(&spec.tokens, &plain.tokens)?;
    Ok((spec, plain))
}

/// Plain decoding's output of each request, decoded once however many checks compare with it.
struct PlainRuns<'a> {
    model: &'a Rc<Gemma4>,
    /// By the request as JSON: its prompt, length and sampling.
    runs: RefCell<HashMap<String, Generation>>,
}

impl PlainRuns<'_> {
    fn of(&self, request: &Request) -> Result<Generation, String> {
        let key = serde_json::to_string(request).map_err(|e| e.to_string())?;
        if let Some(run) = self.runs.borrow().get(&key) {
            return Ok(run.clone());
        }
        let run = generate(self.model, request, |_| Flow::Continue).map_err(|e| e.to_string())?;
        self.runs.borrow_mut().insert(key, run.clone());
        Ok(run)
    }
}

/// Where `got` first departs from plain decoding's `plain`, if it does.
fn compare(got: &[u32], plain: &[u32]) -> Result<(), String> {
    match got.iter().zip(plain).position(|(a, b)| a != b) {
        Some(i) => Err(format!("differs from plain decoding at generated token {i}: {} against {}", got[i], plain[i])),
        None if got.len() != plain.len() => {
            Err(format!("{} tokens where plain decoding made {}", got.len(), plain.len()))
        }
        None => Ok(()),
    }
}

fn summary(g: &Generation) -> String {
    format!(
        "identical to plain decoding; {} tokens, {} drafted, {} accepted",
        g.tokens.len(),
        g.stats.drafted,
        g.stats.accepted
    )
}

/// Every request in one batch from the start, their rows drafted and verified together: each
/// row equals its plain run.
fn batch(plain: &PlainRuns, drafter: &LoadedDrafter, requests: &[Request], gamma: usize) -> Result<String, String> {
    let config = SpecConfig::new(gamma, Verify::Match);
    let rows = generate_speculative_rows(plain.model, drafter, requests, config, |_, _| Flow::Continue)
        .map_err(|e| e.to_string())?;
    for (row, (request, generation)) in requests.iter().zip(&rows).enumerate() {
        if let Some(error) = &generation.stats.drafter_error {
            return Err(format!("row {row}: the host dropped the drafter: {error}"));
        }
        compare(&generation.tokens, &plain.of(request)?.tokens).map_err(|e| format!("row {row}: {e}"))?;
    }
    Ok(format!("each row equals its plain run ({} greedy, the others sampled)", requests.len().div_ceil(2)))
}

/// Requests joining one batch a round apart, one of them cancelled after its fourth token: each
/// row's output equals its plain run (the cancelled one, that run's first four tokens).
fn rows_in_flight(plain: &PlainRuns, drafter: &LoadedDrafter, requests: &[Request]) -> Result<String, String> {
    let config = SpecConfig::new(3, Verify::Match);
    let mut batch = LiveBatch::new(plain.model, Some(drafter), config).map_err(|e| e.to_string())?;
    let cancelled = requests.len().saturating_sub(1).min(1);
    let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
    let mut streamed: Vec<usize> = vec![0; requests.len()];
    let mut round = 0;
    while done.iter().any(Option::is_none) {
        if let Some(request) = requests.get(round) {
            batch.join(round, request.clone(), |_| Flow::Continue).map_err(|e| format!("row {round} joining: {e}"))?;
        }
        let finished = batch
            .round(|row, event| {
                if let Event::Token(_) = event {
                    streamed[row] += 1;
                }
                if row == cancelled && streamed[row] == 4 {
                    Flow::Stop
                } else {
                    Flow::Continue
                }
            })
            .map_err(|e| format!("round {round}: {e}"))?;
        for (row, generation) in finished {
            done[row] = Some(generation);
        }
        round += 1;
        if round > 100_000 {
            return Err("the batch never finished".into());
        }
    }
    for (row, (request, generation)) in requests.iter().zip(&done).enumerate() {
        let generation = generation.as_ref().expect("every row finished");
        if let Some(error) = &generation.stats.drafter_error {
            return Err(format!("row {row}: the host dropped the drafter: {error}"));
        }
        let plain = plain.of(request)?.tokens;
        let expected = match generation.stop {
            StopReason::Interrupted if row == cancelled => &plain[..4.min(plain.len())],
            _ => &plain[..],
        };
        compare(&generation.tokens, expected).map_err(|e| format!("row {row}: {e}"))?;
    }
    Ok(format!("{} rows, one joining per round, row {cancelled} cancelled; each equals its plain run", requests.len()))
}

/// Two requests through one batch with a prefix cache, the second's prompt extending the
/// first's: the second starts from the first's captured state (the target's and the drafter's
/// rows) and still equals its plain run.
fn prefix_cache(
    plain: &PlainRuns,
    drafter: &LoadedDrafter,
    first: &Request,
    second: &Request,
) -> Result<String, String> {
    let config = SpecConfig::new(3, Verify::Match);
    let mut batch =
        LiveBatch::new(plain.model, Some(drafter), config).map_err(|e| e.to_string())?.with_prefix_cache(64 << 20);
    let mut last = None;
    for (i, request) in [first, second].into_iter().enumerate() {
        batch.join(i, request.clone(), |_| Flow::Continue).map_err(|e| format!("request {i} joining: {e}"))?;
        while !batch.is_empty() {
            let finished = batch.round(|_, _| Flow::Continue).map_err(|e| format!("request {i}: {e}"))?;
            last = finished.into_iter().last().map(|(_, g)| g).or(last);
        }
    }
    let generation = last.ok_or("the second request never finished")?;
    if let Some(error) = &generation.stats.drafter_error {
        return Err(format!("the host dropped the drafter: {error}"));
    }
    if generation.stats.cached_prompt_tokens == 0 {
        return Err("the second request reused nothing of the first's prefill".into());
    }
    compare(&generation.tokens, &plain.of(second)?.tokens)?;
    Ok(format!("{} prompt tokens restored; identical to plain decoding", generation.stats.cached_prompt_tokens))
}

/// The measurement over the greedy runs at 3 draft tokens (their stats, and plain decoding's time).
fn measure(runs: &[(crate::generate::Stats, f64)]) -> Option<Measurement> {
    if runs.is_empty() {
        return None;
    }
    let sum = |f: &dyn Fn(&crate::generate::Stats) -> f64| runs.iter().map(|(s, _)| f(s)).sum::<f64>();
    let rounds = sum(&|s| s.rounds as f64).max(1.0);
    let forwards = sum(&|s| s.target_forwards as f64).max(1.0);
    let positions = runs.iter().map(|(s, _)| s.drafted_by_position.len()).max().unwrap_or(0);
    let accepted_by_position = (0..positions)
        .map(|i| {
            let drafted: f64 = runs.iter().map(|(s, _)| *s.drafted_by_position.get(i).unwrap_or(&0) as f64).sum();
            let accepted: f64 = runs
                .iter()
                .map(|(s, _)| {
                    s.accepted_by_position.get(i).unwrap_or(&0.0) * *s.drafted_by_position.get(i).unwrap_or(&0) as f64
                })
                .sum();
            if drafted > 0.0 {
                accepted / drafted
            } else {
                0.0
            }
        })
        .collect();
    let plain_ms: f64 = runs.iter().map(|(_, plain)| plain).sum();
    Some(Measurement {
        tokens_per_forward: sum(&|s| s.generated_tokens as f64) / forwards,
        accepted_by_position,
        draft_ms_per_round: sum(&|s| s.draft_ms) / rounds,
        verify_ms_per_round: sum(&|s| s.verify_ms) / rounds,
        speedup: plain_ms / sum(&|s| s.decode_ms).max(f64::MIN_POSITIVE),
    })
}
