//! The verify loop: a drafter proposes, the target checks every proposal in one forward, the
//! caches keep exactly the accepted rows. The output is the target's own samples, so it equals
//! plain decoding token for token (greedy, and sampled with the same seed: every position is
//! drawn with the key plain decoding would use for it). With draft probabilities, rejection
//! sampling with residual resampling keeps the target's distribution instead.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use mlx_rs::{Array, Dtype};
use plugin_api::PrefillMode;

use crate::generate::{check_request, GenerateError, Generation, Request, Stats, StopReason, PREFILL_CHUNK};
use crate::model::{Gemma4, LayerCache, Taps};
use crate::plugin::drafter::{DraftRows, Proposal};
use crate::plugin::{Drafter, DrafterError};
use crate::sampling::{filtered_logprobs, gumbel_argmax, sample, step_key, uniform};
use crate::target_view::TargetView;

/// How drafted tokens are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verify {
    /// Accept a draft when it equals the target's own sample at that position.
    Match,
    /// Accept with probability min(1, p/q) and resample the residual on rejection; needs
    /// the drafter's probabilities.
    Rejection,
}

#[derive(Debug, Clone, Copy)]
pub struct SpecConfig {
    pub draft_tokens: usize,
    pub verify: Verify,
}

/// Opens a drafter against the target without generating: a pairing the drafter refuses, or
/// one the host cannot serve, fails here, before any request.
pub fn probe_open(model: &Rc<Gemma4>, drafter: &Drafter) -> Result<(), DrafterError> {
    let caches = Rc::new(RefCell::new(Vec::new()));
    let view = TargetView::new(model.clone(), caches);
    let rows = drafter.open(view.boxed(), 1, model.config.vocab_size as u32)?;
    check_pairing(model, drafter, &rows)
}

fn check_pairing(model: &Gemma4, drafter: &Drafter, _rows: &DraftRows) -> Result<(), DrafterError> {
    let caps = &drafter.info.capabilities;
    let layers = model.config.num_hidden_layers as u32;
    let refuse = |reason: String| DrafterError::InvalidAnswer { kind: drafter.info.id.to_string(), call: "open", reason };
    if let Some(bad) = caps.tap_layers.iter().find(|&&l| l > layers) {
        return Err(refuse(format!("tap layer {bad} is beyond the target's {layers} layers (valid: 0..={layers})")));
    }
    if caps.prefill_mode != PrefillMode::TAIL_SPLIT {
        return Err(refuse(format!("prefill mode `{}` is not supported by this host (only tail-split)", caps.prefill_mode.name())));
    }
    Ok(())
}

/// Generates `request` speculatively with `drafter`. A drafter that fails is dropped and the
/// request finishes by plain decoding; `Stats::drafter_error` says why.
pub fn generate_speculative(
    model: &Rc<Gemma4>,
    drafter: &Drafter,
    request: &Request,
    config: SpecConfig,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, GenerateError> {
    check_request(model, request)?;
    let mut stats = Stats { prompt_tokens: request.prompt.len(), ..Stats::default() };
    let caches = Rc::new(RefCell::new(model.make_caches(config.draft_tokens + 1)));
    let view = TargetView::new(model.clone(), caches.clone());
    let mut rows = Some(drafter.open(view.boxed(), 1, model.config.vocab_size as u32).map_err(GenerateError::Drafter)?);
    if let Some(r) = &rows {
        check_pairing(model, drafter, r).map_err(GenerateError::Drafter)?;
    }
    let tap_layers: Vec<usize> = drafter.info.capabilities.tap_layers.iter().map(|&l| l as usize).collect();
    let verify = if request.sampling.is_greedy() { Verify::Match } else { config.verify };
    let mut depth_stats = vec![(0usize, 0usize); config.draft_tokens];

    // Tail-split prefill: every prompt token but the last, which heads the first window.
    let started = Instant::now();
    let (prefix, last) = request.prompt.split_at(request.prompt.len() - 1);
    let mut pending = last[0];
    let mut contexts = Vec::new();
    for chunk in prefix.chunks(PREFILL_CHUNK) {
        let (_, context) = forward(model, &mut caches.borrow_mut(), chunk, &tap_layers)?;
        stats.target_forwards += 1;
        contexts.extend(context);
    }
    if !prefix.is_empty() {
        let context = if contexts.is_empty() { None } else { Some(mlx_rs::ops::concatenate(&contexts, 1)?) };
        drop_on_error(&mut rows, &mut stats, |r| r.prefill(prefix, context.as_ref()));
    }
    stats.prefill_ms = started.elapsed().as_secs_f64() * 1e3;

    let decoding = Instant::now();
    let mut tokens: Vec<u32> = Vec::new();
    let stop = 'generation: loop {
        let remaining = request.max_tokens - tokens.len();
        if remaining == 0 {
            break StopReason::MaxTokens;
        }
        let step = tokens.len() as u64;
        let depth = config.draft_tokens.min(remaining - 1);
        let proposal = match (&mut rows, depth) {
            (Some(_), d) if d > 0 => {
                drop_on_error(&mut rows, &mut stats, |r| r.draft(&[pending], d, &[step]).map(|mut p| p.remove(0)))
                    .unwrap_or_default()
            }
            _ => Proposal::default(),
        };
        let drafts = proposal.tokens.clone();
        let mut window = vec![pending];
        window.extend(&drafts);

        let (hidden, context) = forward(model, &mut caches.borrow_mut(), &window, &tap_layers)?;
        let logits = model.logits_from_hidden(&hidden)?.reshape(&[window.len() as i32, -1])?;
        stats.target_forwards += 1;
        stats.rounds += 1;
        stats.drafted += drafts.len();

        let mut accepted = 0;
        for i in 0..window.len() {
            let row = logits.take_axis(Array::from_int(i as i32), 0)?;
            let draft = drafts.get(i).copied();
            let (token, took_draft) = match (verify, draft, &proposal.probabilities) {
                (Verify::Rejection, Some(d), Some(q)) => rejection_step(&row, q, i, d, request, step + i as u64)?,
                _ => {
                    let t = sample(&row, &request.sampling, step + i as u64)?;
                    (t, draft == Some(t))
                }
            };
            if took_draft {
                accepted += 1;
                depth_stats[i].1 += 1;
            }
            if request.eos.contains(&token) {
                break 'generation StopReason::Eos;
            }
            tokens.push(token);
            on_token(token);
            if tokens.len() == request.max_tokens {
                stats.accepted += accepted;
                break 'generation StopReason::MaxTokens;
            }
            if !took_draft {
                break;
            }
        }
        for d in depth_stats.iter_mut().take(drafts.len()) {
            d.0 += 1;
        }
        stats.accepted += accepted;

        let rejected = drafts.len() - accepted;
        for cache in caches.borrow_mut().iter_mut() {
            cache.rollback(rejected).map_err(|e| GenerateError::Internal(e.to_string()))?;
        }
        let context = context.map(|c| c.take_axis(Array::from_iter(0..window.len() as i32, &[window.len() as i32]), 1)).transpose()?;
        drop_on_error(&mut rows, &mut stats, |r| r.commit(&window, &[accepted as u32], context.as_ref()));
        pending = *tokens.last().expect("every round emits a token");
    };
    stats.decode_ms = decoding.elapsed().as_secs_f64() * 1e3;
    stats.generated_tokens = tokens.len();
    stats.mean_accept_len = if stats.rounds == 0 { 0.0 } else { (stats.accepted + stats.rounds) as f64 / stats.rounds as f64 };
    stats.acceptance_rate = if stats.drafted == 0 { 0.0 } else { stats.accepted as f64 / stats.drafted as f64 };
    stats.accepted_by_position =
        depth_stats.iter().take_while(|(drafted, _)| *drafted > 0).map(|&(d, a)| a as f64 / d as f64).collect();
    stats.prefill_tokens_per_s = per_second(request.prompt.len(), stats.prefill_ms);
    stats.decode_tokens_per_s = per_second(tokens.len(), stats.decode_ms);
    Ok(Generation { tokens, stop, stats })
}

/// The target forward over `ids` (one row), with the hidden states at `taps` concatenated on
/// the feature axis as the drafter's context.
fn forward(model: &Gemma4, caches: &mut [LayerCache], ids: &[u32], taps: &[usize]) -> Result<(Array, Option<Array>), GenerateError> {
    let ids = Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, ids.len() as i32]);
    if taps.is_empty() {
        return Ok((model.forward_hidden(&ids, caches, None)?, None));
    }
    let mut t = Taps { layers: taps.to_vec(), captured: Vec::new() };
    let hidden = model.forward_hidden(&ids, caches, Some(&mut t))?;
    // Captured in layer order; the drafter wants them in its tap order.
    let mut layers = taps.to_vec();
    layers.sort_unstable();
    layers.dedup();
    let ordered: Vec<Array> = taps.iter().map(|l| t.captured[layers.binary_search(l).expect("every tap captured")].clone()).collect();
    Ok((hidden, Some(mlx_rs::ops::concatenate(&ordered, -1)?)))
}

/// Runs a drafter call; on failure the drafter is dropped for the rest of the request and
/// the reason kept in the stats.
fn drop_on_error<T>(rows: &mut Option<DraftRows>, stats: &mut Stats, call: impl FnOnce(&mut DraftRows) -> Result<T, DrafterError>) -> Option<T> {
    let r = rows.as_mut()?;
    match call(r) {
        Ok(v) => Some(v),
        Err(e) => {
            stats.drafter_error = Some(e.to_string());
            *rows = None;
            None
        }
    }
}

/// One position of rejection sampling: accept draft `d` with probability min(1, p(d)/q(d)),
/// else draw from the residual max(p − q, 0). p is the target's distribution after the
/// request's filters and temperature; q is the drafter's row `i`.
fn rejection_step(target_logits: &Array, q: &Array, i: usize, d: u32, request: &Request, step: u64) -> Result<(u32, bool), GenerateError> {
    let params = &request.sampling;
    let logits = target_logits.as_dtype(Dtype::Float32)?;
    let lp = filtered_logprobs(logits.as_slice::<f32>(), params);
    let p = softmax_at_temperature(&lp, params.temperature);
    let q_row = q.take_axis(Array::from_int(i as i32), 0)?.as_dtype(Dtype::Float32)?;
    let q_row = q_row.as_slice::<f32>();
    let key = step_key(params.seed ^ REJECTION_STREAM, step);
    let (pd, qd) = (p[d as usize] as f64, q_row[d as usize] as f64);
    if qd <= 0.0 || uniform(key, 0) < (pd / qd).min(1.0) {
        return Ok((d, true));
    }
    let residual: Vec<f64> = p.iter().zip(q_row).map(|(&p, &q)| (p as f64 - q as f64).max(0.0)).collect();
    let mass: f64 = residual.iter().sum();
    if mass <= 1e-12 {
        return Ok((gumbel_argmax(&lp, params.temperature, params.seed, step), false));
    }
    let mut u = uniform(key, 1) * mass;
    for (token, &r) in residual.iter().enumerate() {
        if u < r {
            return Ok((token as u32, false));
        }
        u -= r;
    }
    Ok((residual.iter().rposition(|&r| r > 0.0).unwrap_or(0) as u32, false))
}

/// Keeps rejection draws apart from the coupled draws of the same step.
const REJECTION_STREAM: u64 = 0x5EC0_17AB_1E5A_3B1D;

fn softmax_at_temperature(logprobs: &[f32], temperature: f32) -> Vec<f32> {
    let scaled: Vec<f64> = logprobs.iter().map(|&x| x as f64 / temperature as f64).collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exp: Vec<f64> = scaled.iter().map(|&x| (x - max).exp()).collect();
    let total: f64 = exp.iter().sum();
    exp.iter().map(|&e| (e / total) as f32).collect()
}

fn per_second(tokens: usize, ms: f64) -> f64 {
    if ms > 0.0 { tokens as f64 / (ms / 1e3) } else { 0.0 }
}
