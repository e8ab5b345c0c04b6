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
use crate::sampling::{filtered_logprobs, gumbel_argmax, step_key, uniform, WindowTokens};
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
    drafter.open(view.boxed(), 1, model.config.vocab_size as u32)?;
    check_pairing(model, drafter)
}

/// What the host itself needs of a drafter: taps inside the target, a prefill it performs.
fn check_pairing(model: &Gemma4, drafter: &Drafter) -> Result<(), DrafterError> {
    let caps = &drafter.info.capabilities;
    let layers = model.config.num_hidden_layers as u32;
    let refuse = |reason: String| DrafterError::InvalidAnswer { kind: drafter.kind().to_owned(), call: "open", reason };
    if let Some(bad) = caps.tap_layers.iter().find(|&&l| l > layers) {
        return Err(refuse(format!("tap layer {bad} is beyond the target's {layers} layers (valid: 0..={layers})")));
    }
    if caps.prefill_mode != PrefillMode::TAIL_SPLIT {
        return Err(refuse(format!(
            "prefill mode `{}` is not supported by this host (only tail-split)",
            caps.prefill_mode.name()
        )));
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
    let mut out = generate_speculative_rows(model, drafter, std::slice::from_ref(request), config, |_, t| on_token(t))?;
    Ok(out.remove(0))
}

/// One request's progress.
struct Row {
    tokens: Vec<u32>,
    pending: u32,
    stop: Option<StopReason>,
    stats: Stats,
    /// Per draft position: (times drafted, times accepted).
    by_position: Vec<(usize, usize)>,
}

/// Generates several requests as rows of one batch: one target forward per round for all
/// rows, each row keeping its own accepted length. Each row's output equals what it would be
/// alone. `on_token(row, token)` sees every token as it is produced.
pub fn generate_speculative_rows(
    model: &Rc<Gemma4>,
    drafter: &Drafter,
    requests: &[Request],
    config: SpecConfig,
    mut on_token: impl FnMut(usize, u32),
) -> Result<Vec<Generation>, GenerateError> {
    for request in requests {
        check_request(model, request)?;
    }
    let vocab = model.config.vocab_size as u32;
    let slack = config.draft_tokens + 1;
    let tap_layers: Vec<usize> = drafter.info.capabilities.tap_layers.iter().map(|&l| l as usize).collect();
    let mut rows: Vec<Row> = requests
        .iter()
        .map(|r| Row {
            tokens: Vec::new(),
            pending: *r.prompt.last().expect("checked non-empty"),
            stop: (r.max_tokens == 0).then_some(StopReason::MaxTokens),
            stats: Stats { prompt_tokens: r.prompt.len(), ..Stats::default() },
            by_position: vec![(0, 0); config.draft_tokens],
        })
        .collect();

    // Tail-split prefill, row by row: every prompt token but the last, which heads the row's
    // first window. Each row gets its own caches and drafter row; they are joined afterwards.
    let caches = Rc::new(RefCell::new(Vec::new()));
    let view = TargetView::new(model.clone(), caches.clone());
    let started = Instant::now();
    let mut row_caches = Vec::new();
    let mut drafter_rows: Vec<DraftRows> = Vec::new();
    let mut drafter_error = None;
    for (r, request) in requests.iter().enumerate() {
        let prefix = &request.prompt[..request.prompt.len() - 1];
        let mut own = model.make_caches(1, slack);
        let mut contexts = Vec::new();
        for chunk in prefix.chunks(PREFILL_CHUNK) {
            let (_, context) = forward(model, &mut own, &[chunk], &tap_layers)?;
            rows[r].stats.target_forwards += 1;
            contexts.extend(context);
        }
        row_caches.push(own);
        if drafter_error.is_none() {
            let mut one = drafter.open(view.boxed(), 1, vocab).map_err(GenerateError::Drafter)?;
            check_pairing(model, drafter).map_err(GenerateError::Drafter)?;
            let context = if contexts.is_empty() { None } else { Some(mlx_rs::ops::concatenate(&contexts, 1)?) };
            let prefilled = if prefix.is_empty() { Ok(()) } else { one.prefill(prefix, context.as_ref()) };
            match prefilled {
                Ok(()) => drafter_rows.push(one),
                Err(e) => drafter_error = Some(e.to_string()),
            }
        }
    }
    *caches.borrow_mut() = join_caches(row_caches)?;
    let mut group = match (drafter_error.is_none(), drafter_rows.len()) {
        (true, 1) => drafter_rows.pop(),
        (true, _) => match join_rows(drafter, &view, drafter_rows, vocab) {
            Ok(g) => Some(g),
            Err(e) => {
                drafter_error = Some(e.to_string());
                None
            }
        },
        _ => None,
    };
    let prefill_ms = started.elapsed().as_secs_f64() * 1e3;

    let decoding = Instant::now();
    // Rows still generating, in the order of the caches and the drafter group.
    let mut active: Vec<usize> = (0..rows.len()).collect();
    drop_finished(&mut active, &rows, &caches, &mut group, &mut drafter_error)?;
    while !active.is_empty() {
        let depths: Vec<usize> = active
            .iter()
            .map(|&r| config.draft_tokens.min(requests[r].max_tokens - rows[r].tokens.len() - 1))
            .collect();
        let depth = depths.iter().copied().max().unwrap_or(0);
        let mut proposals: Vec<Proposal> = active.iter().map(|_| Proposal::default()).collect();
        if let (Some(g), true) = (group.as_mut(), depth > 0) {
            let pending: Vec<u32> = active.iter().map(|&r| rows[r].pending).collect();
            let steps: Vec<u64> = active.iter().map(|&r| rows[r].tokens.len() as u64).collect();
            match g.draft(&pending, depth, &steps) {
                Ok(p) => proposals = p,
                Err(e) => {
                    drafter_error = Some(e.to_string());
                    group = None;
                }
            }
        }
        for (p, &d) in proposals.iter_mut().zip(&depths) {
            if p.tokens.len() > d {
                p.tokens.truncate(d);
                p.probabilities = p
                    .probabilities
                    .take()
                    .map(|q| q.take_axis(Array::from_iter(0..d as i32, &[d as i32]), 0))
                    .transpose()?;
            }
        }

        // One forward over every row's [pending, drafts…], right-padded to the longest.
        let width = 1 + proposals.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
        let windows: Vec<Vec<u32>> = active
            .iter()
            .zip(&proposals)
            .map(|(&r, p)| {
                let mut w = vec![rows[r].pending];
                w.extend(&p.tokens);
                w.resize(width, rows[r].pending);
                w
            })
            .collect();
        let (hidden, context) = forward(
            model,
            &mut caches.borrow_mut(),
            &windows.iter().map(Vec::as_slice).collect::<Vec<_>>(),
            &tap_layers,
        )?;
        let logits = model.logits_from_hidden(&hidden)?;

        let mut accepted = Vec::with_capacity(active.len());
        for (b, (&r, proposal)) in active.iter().zip(&proposals).enumerate() {
            let row_logits = logits.take_axis(Array::from_int(b as i32), 0)?;
            let n = walk(&mut rows[r], &requests[r], proposal, &row_logits, config.verify, |t| on_token(r, t))?;
            accepted.push(n);
        }

        let rollback: Vec<usize> = accepted.iter().map(|&a| width - 1 - a).collect();
        for cache in caches.borrow_mut().iter_mut() {
            cache.rollback(&rollback).map_err(|e| GenerateError::Internal(e.to_string()))?;
        }
        if let Some(g) = group.as_mut() {
            let flat: Vec<u32> = windows.concat();
            let counts: Vec<u32> = accepted.iter().map(|&a| a as u32).collect();
            if let Err(e) = g.commit(&flat, &counts, context.as_ref()) {
                drafter_error = Some(e.to_string());
                group = None;
            }
        }

        drop_finished(&mut active, &rows, &caches, &mut group, &mut drafter_error)?;
    }
    let decode_ms = decoding.elapsed().as_secs_f64() * 1e3;

    Ok(rows
        .into_iter()
        .map(|row| {
            let mut s = row.stats;
            s.prefill_ms = prefill_ms;
            s.decode_ms = decode_ms;
            s.generated_tokens = row.tokens.len();
            s.drafter_error = drafter_error.clone();
            s.mean_accept_len = if s.rounds == 0 { 0.0 } else { (s.accepted + s.rounds) as f64 / s.rounds as f64 };
            s.acceptance_rate = if s.drafted == 0 { 0.0 } else { s.accepted as f64 / s.drafted as f64 };
            s.accepted_by_position =
                row.by_position.iter().take_while(|(d, _)| *d > 0).map(|&(d, a)| a as f64 / d as f64).collect();
            s.prefill_tokens_per_s = per_second(s.prompt_tokens, prefill_ms);
            s.decode_tokens_per_s = per_second(row.tokens.len(), decode_ms);
            Generation { tokens: row.tokens, stop: row.stop.unwrap_or(StopReason::MaxTokens), stats: s }
        })
        .collect())
}

/// Removes finished rows from the batch: from `active`, the caches and the drafter group.
fn drop_finished(
    active: &mut Vec<usize>,
    rows: &[Row],
    caches: &RefCell<Vec<LayerCache>>,
    group: &mut Option<DraftRows>,
    drafter_error: &mut Option<String>,
) -> Result<(), GenerateError> {
    let still: Vec<usize> = (0..active.len()).filter(|&b| rows[active[b]].stop.is_none()).collect();
    if still.len() < active.len() && !still.is_empty() {
        for cache in caches.borrow_mut().iter_mut() {
            cache.filter_rows(&still)?;
        }
        if let Some(g) = group.as_mut() {
            if let Err(e) = g.filter_rows(&still.iter().map(|&b| b as u32).collect::<Vec<_>>()) {
                *drafter_error = Some(e.to_string());
                *group = None;
            }
        }
    }
    *active = still.iter().map(|&b| active[b]).collect();
    Ok(())
}

/// The accept walk of one row over its window's logits [W, V]: the target's own token at
/// each position, accepting drafts while they agree. Returns the accepted draft count.
fn walk(
    row: &mut Row,
    request: &Request,
    proposal: &Proposal,
    logits: &Array,
    verify: Verify,
    mut emit: impl FnMut(u32),
) -> Result<usize, GenerateError> {
    let drafts = &proposal.tokens;
    let step = row.tokens.len() as u64;
    let verify = if request.sampling.is_greedy() { Verify::Match } else { verify };
    row.stats.rounds += 1;
    row.stats.target_forwards += 1;
    row.stats.drafted += drafts.len();
    for d in row.by_position.iter_mut().take(drafts.len()) {
        d.0 += 1;
    }
    let window = WindowTokens::new(
        &logits.take_axis(Array::from_iter(0..=drafts.len() as i32, &[drafts.len() as i32 + 1]), 0)?,
        &request.sampling,
    )?;
    let mut accepted = 0;
    for i in 0..=drafts.len() {
        let draft = drafts.get(i).copied();
        let (token, took_draft) = match (verify, draft, &proposal.probabilities, window.row(i)) {
            (Verify::Rejection, Some(d), Some(q), Some(row)) => rejection_step(row, q, i, d, request, step + i as u64)?,
            _ => {
                let t = window.token(i, &request.sampling, step + i as u64);
                (t, draft == Some(t))
            }
        };
        if took_draft {
            accepted += 1;
            row.by_position[i].1 += 1;
            row.stats.accepted += 1;
        }
        if request.eos.contains(&token) {
            row.stop = Some(StopReason::Eos);
            break;
        }
        row.tokens.push(token);
        emit(token);
        if row.tokens.len() == request.max_tokens {
            row.stop = Some(StopReason::MaxTokens);
            break;
        }
        if !took_draft {
            break;
        }
    }
    if let Some(&last) = row.tokens.last() {
        row.pending = last;
    }
    Ok(accepted)
}

/// The caches of rows prefilled apart, as one batch.
fn join_caches(rows: Vec<Vec<LayerCache>>) -> Result<Vec<LayerCache>, GenerateError> {
    let layers = rows.first().map_or(0, Vec::len);
    let mut by_layer: Vec<Vec<LayerCache>> = (0..layers).map(|_| Vec::new()).collect();
    for row in rows {
        for (layer, cache) in row.into_iter().enumerate() {
            by_layer[layer].push(cache);
        }
    }
    Ok(by_layer.into_iter().map(LayerCache::stack).collect::<Result<_, _>>()?)
}

/// One drafter group holding the rows prefilled apart: each captured and appended in order.
fn join_rows(
    drafter: &Drafter,
    view: &TargetView,
    parts: Vec<DraftRows>,
    vocab: u32,
) -> Result<DraftRows, DrafterError> {
    let mut group = drafter.open(view.boxed(), 0, vocab)?;
    let mut states = Vec::with_capacity(parts.len());
    for mut part in parts {
        states.push(part.capture(0)?);
    }
    group.append(states)?;
    Ok(group)
}

/// The target forward over rows of equal length, with the drafter's context: the hidden
/// states at `taps` concatenated on the feature axis, or the final hidden states.
fn forward(
    model: &Gemma4,
    caches: &mut [LayerCache],
    rows: &[&[u32]],
    taps: &[usize],
) -> Result<(Array, Option<Array>), GenerateError> {
    let flat: Vec<i32> = rows.iter().flat_map(|r| r.iter().map(|&t| t as i32)).collect();
    let ids = Array::from_slice(&flat, &[rows.len() as i32, rows.first().map_or(0, |r| r.len()) as i32]);
    if taps.is_empty() {
        let hidden = model.forward_hidden(&ids, caches, None)?;
        return Ok((hidden.clone(), Some(hidden)));
    }
    let mut t = Taps { layers: taps.to_vec(), captured: Vec::new() };
    let hidden = model.forward_hidden(&ids, caches, Some(&mut t))?;
    // Captured in layer order; the drafter wants them in its tap order.
    let mut layers = taps.to_vec();
    layers.sort_unstable();
    layers.dedup();
    let ordered: Vec<Array> =
        taps.iter().map(|l| t.captured[layers.binary_search(l).expect("every tap captured")].clone()).collect();
    Ok((hidden, Some(mlx_rs::ops::concatenate(&ordered, -1)?)))
}

/// One position of rejection sampling: accept draft `d` with probability min(1, p(d)/q(d)),
/// else draw from the residual max(p − q, 0). p is the target's distribution after the
/// request's filters and temperature; q is the drafter's row `i`.
fn rejection_step(
    target_logits: &[f32],
    q: &Array,
    i: usize,
    d: u32,
    request: &Request,
    step: u64,
) -> Result<(u32, bool), GenerateError> {
    let params = &request.sampling;
    let lp = filtered_logprobs(target_logits, params);
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
    if ms > 0.0 {
        tokens as f64 / (ms / 1e3)
    } else {
        0.0
    }
}
