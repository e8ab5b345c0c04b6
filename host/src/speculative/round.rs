//! One round of the verify loop for every active row: draft → verify (one target forward) →
//! accept per row → rollback → commit.

use std::cell::RefCell;
use std::time::Instant;

use mlx_rs::Array;

use super::accept::accept;
use super::catch_up::CatchUp;
use super::slot::DrafterSlot;
use super::{forward, Row, SpecConfig, Taps, Verify};
use crate::generate::{Event, Flow, GenerateError, Request};
use crate::model::{Gemma4, LayerCache};
use crate::sampling::{WindowRow, WindowTokens};
use plugin_api::sdk::Proposal;

/// The batch as the rounds see it: rows still generating, in the order of the caches and of
/// the drafter's rows.
pub(super) struct Batch<'a> {
    pub model: &'a Gemma4,
    pub caches: &'a RefCell<Vec<LayerCache>>,
    pub requests: &'a [Request],
    pub config: SpecConfig,
    pub taps: &'a Taps,
    pub active: Vec<usize>,
}

pub(super) fn round(
    batch: &Batch,
    rows: &mut [Row],
    slot: &mut DrafterSlot,
    catch_up: &mut CatchUp,
    on_event: &mut impl FnMut(usize, Event) -> Flow,
) -> Result<(), GenerateError> {
    let drafting = Instant::now();
    let proposals = draft(batch, rows, slot, catch_up)?;
    let draft_ms = ms_since(drafting);
    let verifying = Instant::now();

    // One forward over every row's [pending, drafts…], right-padded to the longest.
    let width = 1 + proposals.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    let windows: Vec<Vec<u32>> = batch
        .active
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
        batch.model,
        &mut batch.caches.borrow_mut(),
        &windows.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        batch.taps,
    )?;
    let logits = batch.model.logits_from_hidden(&hidden)?;

    let window_rows: Vec<WindowRow> = batch
        .active
        .iter()
        .zip(&proposals)
        .map(|(&r, p)| {
            let params = &batch.requests[r].sampling;
            let rejection = batch.config.verify == Verify::Rejection && p.probabilities.is_some();
            WindowRow {
                params,
                first_step: rows[r].tokens.len() as u64,
                distributions: rejection && !params.is_greedy(),
            }
        })
        .collect();
    let first_step = window_rows.iter().map(|w| w.first_step as usize).min().unwrap_or(0);
    let targets = WindowTokens::rows(&logits, &window_rows).map_err(|e| GenerateError::sampling_at(first_step, e))?;
    let mut accepted = Vec::with_capacity(batch.active.len());
    for ((&r, proposal), window) in batch.active.iter().zip(&proposals).zip(&targets) {
        let verify = batch.config.verify;
        accepted.push(accept(&mut rows[r], &batch.requests[r], proposal, window, verify, |t| {
            on_event(r, Event::Token(t))
        })?);
    }

    // The caches keep exactly what was accepted: the pending token and the accepted drafts.
    let rollback: Vec<usize> = accepted.iter().map(|&a| width - 1 - a).collect();
    for cache in batch.caches.borrow_mut().iter_mut() {
        cache.rollback(&rollback).map_err(|e| GenerateError::Internal(e.to_string()))?;
    }
    let verify_ms = ms_since(verifying);
    let committing = Instant::now();
    let flat: Vec<u32> = windows.concat();
    if width == 1 {
        // Nothing was drafted: the drafter sees these tokens when it next drafts.
        catch_up.push(flat, context, slot)?;
    } else {
        let counts: Vec<u32> = accepted.iter().map(|&a| a as u32).collect();
        slot.call(|g| g.commit(&flat, &counts, context.as_ref()));
    }
    let draft_ms = draft_ms + ms_since(committing);
    for &r in &batch.active {
        rows[r].stats.draft_ms += draft_ms;
        rows[r].stats.verify_ms += verify_ms;
    }
    Ok(())
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Each active row's proposal, no deeper than the round's draft length and its remaining budget
/// allow (a row one token from `max_tokens` gets none); empty proposals when the drafter is gone.
fn draft(
    batch: &Batch,
    rows: &[Row],
    slot: &mut DrafterSlot,
    catch_up: &mut CatchUp,
) -> Result<Vec<Proposal>, GenerateError> {
    let depths: Vec<usize> = batch
        .active
        .iter()
        .map(|&r| {
            let budget = batch.requests[r].max_tokens - rows[r].tokens.len() - 1;
            rows[r].draft_tokens().min(batch.config.draft_tokens).min(budget)
        })
        .collect();
    let depth = depths.iter().copied().max().unwrap_or(0);
    let empty = || batch.active.iter().map(|_| Proposal::default()).collect::<Vec<_>>();
    if depth == 0 {
        return Ok(empty());
    }
    catch_up.flush(slot)?;
    let pending: Vec<u32> = batch.active.iter().map(|&r| rows[r].pending).collect();
    let steps: Vec<u64> = batch.active.iter().map(|&r| rows[r].tokens.len() as u64).collect();
    let Some(mut proposals) = slot.call(|g| g.draft(&pending, depth, &steps)) else { return Ok(empty()) };
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
    Ok(proposals)
}
