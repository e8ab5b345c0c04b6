//! One round of the verify loop for every active row: draft → verify (one target forward) →
//! accept per row → rollback → commit. Rounds whose rows draft branching trees take
//! [`tree_round`] instead.

use std::cell::RefCell;
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::accept::accept;
use super::catch_up::CatchUp;
use super::slot::DrafterSlot;
use super::tree_round::{draft_trees, tree_round};
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

impl Batch<'_> {
    /// The most each active row may draft this round: the round's draft length, and no draft
    /// that would pass the row's `max_tokens` (none one token from it).
    pub fn draft_depths(&self, rows: &[Row]) -> Vec<usize> {
        self.active.iter().map(|&r| rows[r].draft_room(&self.requests[r]).min(self.config.draft_tokens)).collect()
    }

    /// What the accept step of row `r` needs of its window; its distributions where the round
    /// verifies by rejection and the row's drafts came with probabilities.
    pub fn window_row(&self, r: usize, row: &Row, with_probabilities: bool) -> WindowRow<'_> {
        let params = &self.requests[r].sampling;
        let rejection = self.config.verify == Verify::Rejection && with_probabilities;
        WindowRow {
            params,
            on_host: self.requests[r].chosen_on_host(),
            first_step: row.tokens.len() as u64,
            distributions: rejection && !params.is_greedy(),
        }
    }
}

/// What a round drafted and what it cost, for `"auto"` draft lengths.
pub(super) struct RoundTimes {
    /// Tokens drafted by the deepest row.
    pub depth: usize,
    /// Tokens in the verify forward, all rows together.
    pub window_tokens: usize,
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Whether the round verified branching trees ([`tree_round`]).
    pub branched: bool,
}

pub(super) fn round(
    batch: &Batch,
    rows: &mut [Row],
    slot: &mut DrafterSlot,
    catch_up: &mut CatchUp,
    on_event: &mut impl FnMut(usize, Event) -> Flow,
) -> Result<RoundTimes, GenerateError> {
    let pending: Vec<u32> = batch.active.iter().map(|&r| rows[r].pending).collect();
    let drafting = Instant::now();
    let trees = draft_trees(batch, rows, &pending, slot, catch_up)?;
    // Trees that are all chains verify as chains: the tree route would gather each row's keys
    // and masks for the same rows.
    let from_trees = trees.is_some();
    let drafted = match trees {
        Some(trees) if !trees.iter().all(|t| t.tree.is_chain()) => {
            return tree_round(batch, rows, &pending, trees, ms_since(drafting), slot, on_event);
        }
        Some(chains) => {
            let proposals: Vec<Proposal> = chains
                .into_iter()
                .map(|t| Proposal { tokens: t.tree.tokens, probabilities: t.probabilities })
                .collect();
            Drafted::Host { windows: host_windows(&pending, &proposals), proposals }
        }
        None => draft(batch, rows, &pending, slot, catch_up)?,
    };
    let draft_ms = ms_since(drafting);
    let verifying = Instant::now();

    // One forward over every row's [pending, drafts…], right-padded to the longest.
    let ids = drafted.window_ids(&pending, batch.model.config.vocab_size)?;
    let width = ids.shape()[1] as usize;
    let (hidden, context) = forward(batch.model, &mut batch.caches.borrow_mut(), &ids, batch.taps)?;
    let logits = batch.model.logits_from_hidden(&hidden)?;

    let window_rows: Vec<WindowRow> = batch
        .active
        .iter()
        .enumerate()
        .map(|(i, &r)| batch.window_row(r, &rows[r], drafted.has_probabilities(i)))
        .collect();
    let first_step = window_rows.iter().map(|w| w.first_step as usize).min().unwrap_or(0);
    // The window's tokens, and drafts left on the device, in one wait.
    let targets = WindowTokens::rows(&logits, &window_rows, drafted.on_device())
        .map_err(|e| GenerateError::sampling_at(first_step, e))?;
    let (proposals, windows) = drafted.read(&pending, slot);
    let mut accepted = Vec::with_capacity(batch.active.len());
    for ((&r, proposal), window) in batch.active.iter().zip(&proposals).zip(&targets) {
        let verify = batch.config.verify;
        let kept = accept(&mut rows[r], &batch.requests[r], proposal, window, verify, |t, logprob| {
            if let Some(l) = logprob {
                on_event(r, Event::Logprob(l));
            }
            on_event(r, Event::Token(t))
        })?;
        if from_trees {
            // A chain's nodes are ranked in its order; "auto" sizes trees from these counts.
            rows[r].nodes.record(proposal.tokens.len(), &(0..kept).collect::<Vec<_>>());
        }
        accepted.push(kept);
    }

    // The caches keep exactly what was accepted: the pending token and the accepted drafts.
    let rollback: Vec<usize> = accepted.iter().map(|&a| width - 1 - a).collect();
    for cache in batch.caches.borrow_mut().iter_mut() {
        cache.rollback(&rollback).map_err(|e| GenerateError::Internal(e.to_string()))?;
    }
    let verify_ms = ms_since(verifying);
    let committing = Instant::now();
    if width == 1 {
        // Nothing was drafted: the drafter sees these tokens when it next drafts.
        catch_up.push(windows, context, slot)?;
    } else {
        let counts: Vec<u32> = accepted.iter().map(|&a| a as u32).collect();
        slot.call(|g| g.commit(&windows, &counts, context.as_ref()));
    }
    let draft_ms = draft_ms + ms_since(committing);
    for &r in &batch.active {
        rows[r].stats.draft_ms += draft_ms;
        rows[r].stats.verify_ms += verify_ms;
    }
    let window_tokens = batch.active.len() * width;
    Ok(RoundTimes { depth: width - 1, window_tokens, draft_ms, verify_ms, branched: false })
}

pub(super) fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// A round's drafts: in host memory, or (the extension `device-draft/1`) `depths[r]` of
/// `depth` tokens per row in an array [rows, depth] the device may still be computing.
enum Drafted {
    /// The proposals, and the verify windows they make ([`host_windows`]).
    Host {
        proposals: Vec<Proposal>,
        windows: Vec<u32>,
    },
    OnDevice {
        tokens: Array,
        depths: Vec<usize>,
    },
}

impl Drafted {
    /// The verify forward's input [rows, 1 + drafts]: each row's pending token and its drafts.
    /// Device drafts are clamped into the vocabulary, so that a wrong id cannot index past the
    /// embedding; once read they are checked.
    fn window_ids(&self, pending: &[u32], vocab: i32) -> Result<Array, Exception> {
        match self {
            Drafted::Host { windows, .. } => {
                let flat: Vec<i32> = windows.iter().map(|&t| t as i32).collect();
                Ok(Array::from_slice(&flat, &[pending.len() as i32, (windows.len() / pending.len()) as i32]))
            }
            Drafted::OnDevice { tokens, .. } => {
                let heads: Vec<i32> = pending.iter().map(|&t| t as i32).collect();
                let heads = Array::from_slice(&heads, &[heads.len() as i32, 1]);
                let inside =
                    mlx_rs::ops::minimum(tokens, Array::from_int(vocab - 1))?.as_dtype(mlx_rs::Dtype::Int32)?;
                mlx_rs::ops::concatenate(&[heads, inside], 1)
            }
        }
    }

    fn has_probabilities(&self, row: usize) -> bool {
        matches!(self, Drafted::Host { proposals, .. } if proposals[row].probabilities.is_some())
    }

    /// What the round's one wait also computes.
    fn on_device(&self) -> &[Array] {
        match self {
            Drafted::Host { .. } => &[],
            Drafted::OnDevice { tokens, .. } => std::slice::from_ref(tokens),
        }
    }

    /// Each row's proposal on the host, and the verify windows [rows · width] as the drafter's
    /// commit reads them. Device drafts are read (computed by the round's wait) and checked: ids
    /// outside the vocabulary drop the drafter and propose nothing.
    fn read(self, pending: &[u32], slot: &mut DrafterSlot) -> (Vec<Proposal>, Vec<u32>) {
        match self {
            Drafted::Host { proposals, windows } => (proposals, windows),
            Drafted::OnDevice { tokens, depths } => {
                let all = tokens.as_slice::<u32>();
                let drafts = all.len() / pending.len();
                let windows =
                    pending.iter().zip(all.chunks(drafts)).flat_map(|(&head, row)| [&[head], row].concat()).collect();
                let proposals = match slot.call(|g| g.check_device_drafts(all)) {
                    Some(()) => {
                        all.chunks(drafts).zip(&depths).map(|(row, &d)| Proposal::tokens(row[..d].to_vec())).collect()
                    }
                    None => depths.iter().map(|_| Proposal::default()).collect(),
                };
                (proposals, windows)
            }
        }
    }
}

/// Each row's [pending, drafts…], right-padded with its pending token to the longest, flat.
fn host_windows(pending: &[u32], proposals: &[Proposal]) -> Vec<u32> {
    let width = 1 + proposals.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    pending
        .iter()
        .zip(proposals)
        .flat_map(|(&head, p)| {
            std::iter::once(head).chain(p.tokens.iter().copied()).chain(std::iter::repeat(head)).take(width)
        })
        .collect()
}

/// Each active row's proposal, no deeper than the round's draft length and its remaining budget
/// allow (a row one token from `max_tokens` gets none); empty proposals when the drafter is gone.
/// Off the CPU loops' route a round that needs no draft probabilities takes the drafter's
/// tokens on the device where it offers them.
fn draft(
    batch: &Batch,
    rows: &[Row],
    pending: &[u32],
    slot: &mut DrafterSlot,
    catch_up: &mut CatchUp,
) -> Result<Drafted, GenerateError> {
    let depths = batch.draft_depths(rows);
    let depth = depths.iter().copied().max().unwrap_or(0);
    let host = |proposals: Vec<Proposal>| Drafted::Host { windows: host_windows(pending, &proposals), proposals };
    let empty = || host(batch.active.iter().map(|_| Proposal::default()).collect());
    if depth == 0 {
        return Ok(empty());
    }
    catch_up.flush(slot)?;
    let steps: Vec<u64> = batch.active.iter().map(|&r| rows[r].tokens.len() as u64).collect();
    let greedy = batch.active.iter().all(|&r| batch.requests[r].sampling.is_greedy());
    if !kernels::route::on_cpu() && (batch.config.verify == Verify::Match || greedy) {
        if let Some(Some(tokens)) = slot.call(|g| g.draft_on_device(pending, depth, &steps)) {
            // The device computes the drafts while the host builds the verify forward on them.
            mlx_rs::transforms::async_eval([&tokens])?;
            return Ok(Drafted::OnDevice { tokens, depths });
        }
    }
    let Some(mut proposals) = slot.call(|g| g.draft(pending, depth, &steps)) else { return Ok(empty()) };
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
    Ok(host(proposals))
}
