//! A batch that rows join and leave between rounds (continuous batching). Each row is prefilled
//! on its own and joined to the running batch: its caches stacked onto the batch's, its drafter
//! row captured and appended to the batch's drafter. Finished rows leave through `filter_rows`.
//! A row's output does not depend on which rows share its rounds.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use super::catch_up::CatchUp;
use super::depth::{chain_rate, choose_depth, RoundCosts, AUTO_MOST};
use super::prefill::prefill_row;
use super::prefix_cache::PrefixCache;
use super::round::{round, Batch};
use super::slot::DrafterSlot;
use super::tree_size::{choose_nodes, tree_rate};
use super::{check_pairing, Row, SpecConfig, Taps};
use crate::generate::{check_request, Event, Flow, GenerateError, Generation, Request};
use crate::model::{Gemma4, LayerCache};
use crate::plugin::LoadedDrafter;
use crate::target_view::TargetView;

/// Who a row is and when it started.
struct Member<Id> {
    id: Id,
    prefill_ms: f64,
    decoding: Instant,
}

pub struct LiveBatch<'a, Id> {
    model: &'a Gemma4,
    drafter: Option<&'a LoadedDrafter>,
    config: SpecConfig,
    taps: Taps,
    /// The batch's caches, one row per member in order; `view` lends them to the drafter.
    caches: Rc<RefCell<Vec<LayerCache>>>,
    view: TargetView,
    slot: DrafterSlot,
    /// What the drafter has not been shown yet (rounds that drafted nothing).
    catch_up: CatchUp,
    /// Per row, in the order of the caches and of the drafter's rows.
    members: Vec<Member<Id>>,
    requests: Vec<Request>,
    rows: Vec<Row>,
    prefixes: Option<PrefixCache>,
    /// The most tokens a row drafts in a round.
    most: usize,
    /// `draft_tokens = "auto"` with a drafter: the costs each round's depth and trees' size
    /// are chosen by.
    costs: Option<RoundCosts>,
}

impl<'a, Id: Copy> LiveBatch<'a, Id> {
    /// An empty batch of `model` with `drafter` (or plain decoding through the same loop). A
    /// pairing the host cannot serve is refused here.
    pub fn new(
        model: &'a Rc<Gemma4>,
        drafter: Option<&'a LoadedDrafter>,
        config: SpecConfig,
    ) -> Result<Self, GenerateError> {
        if let Some(d) = drafter {
            check_pairing(model, d).map_err(GenerateError::Drafter)?;
        }
        let costs = match drafter {
            Some(_) if config.auto => Some(RoundCosts::new(&super::measure::verify_ms(model)?, model.group.is_none())),
            _ => None,
        };
        let caches = Rc::new(RefCell::new(Vec::new()));
        let ports = drafter.map_or(plugin_api::Ports::NONE, |d| d.info.capabilities.ports);
        Ok(LiveBatch {
            model,
            drafter,
            config,
            taps: drafter.map_or(Taps::None, Taps::of),
            view: TargetView::new(model.clone(), caches.clone(), ports),
            caches,
            slot: DrafterSlot::Absent,
            catch_up: CatchUp::default(),
            members: Vec::new(),
            requests: Vec::new(),
            rows: Vec::new(),
            prefixes: None,
            most: config.draft_tokens,
            costs,
        })
    }

    /// Keeps prefilled prompts, up to `bytes` of target caches, so that a prompt extending an
    /// earlier one prefills only its new tokens. The output is the same with or without.
    pub fn with_prefix_cache(mut self, bytes: usize) -> Self {
        self.prefixes = (bytes > 0).then(|| PrefixCache::new(bytes));
        self
    }

    /// From the next round on, rows draft at most `n` tokens (0: none), no more than the
    /// batch's configured length; under `"auto"` the rounds choose below it.
    pub fn set_draft_tokens(&mut self, n: usize) {
        self.most = n.min(self.config.draft_tokens);
    }

    /// Bytes of target caches the prefix cache holds.
    pub fn prefix_cache_bytes(&self) -> usize {
        self.prefixes.as_ref().map_or(0, PrefixCache::bytes)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Prefills `request` and joins it to the batch; `on_event` sees the prefill's progress. A
    /// request the model cannot serve is refused without touching the batch.
    pub fn join(&mut self, id: Id, request: Request, on_event: impl FnMut(Event) -> Flow) -> Result<(), GenerateError> {
        self.join_drafting(id, request, self.config.draft_tokens, on_event)
    }

    /// [`LiveBatch::join`] for a row that drafts at most `draft_tokens` per round (no more than
    /// the batch's own draft length, which sized the caches' rollback).
    pub fn join_drafting(
        &mut self,
        id: Id,
        request: Request,
        draft_tokens: usize,
        mut on_event: impl FnMut(Event) -> Flow,
    ) -> Result<(), GenerateError> {
        check_request(self.model, &request)?;
        let started = Instant::now();
        let mut row = Row::new(&request, draft_tokens.min(self.config.draft_tokens));
        let slack = self.config.draft_tokens + 1;
        let prefix = &request.prompt[..request.prompt.len() - 1];
        let from = self.prefixes.as_mut().and_then(|c| c.take_longest(prefix));
        row.stats.cached_prompt_tokens = from.as_ref().map_or(0, |p| p.len);
        let (caches, mut slot) = prefill_row(
            self.model,
            self.drafter,
            &self.view,
            &request,
            &mut row,
            slack,
            &self.taps,
            from,
            &mut on_event,
        )?;
        if let Some(cache) = &mut self.prefixes {
            // With a drafter, a prefix is kept only with its drafter row.
            match (&mut slot, self.drafter) {
                (_, None) => cache.insert(prefix.to_vec(), caches.clone(), None),
                (DrafterSlot::Active(one), Some(_)) => {
                    if let Ok(state) = one.capture(0) {
                        cache.insert(prefix.to_vec(), caches.clone(), Some(state));
                    }
                }
                _ => {}
            }
        }
        if self.members.is_empty() {
            // The row's own drafter, opened over `view`, becomes the batch's.
            *self.caches.borrow_mut() = caches;
            self.slot = slot;
        } else {
            self.catch_up.flush(&mut self.slot)?;
            let mut live = self.caches.borrow_mut();
            let joined = std::mem::take(&mut *live)
                .into_iter()
                .zip(caches)
                .map(|(batch, one)| LayerCache::stack(vec![batch, one]))
                .collect::<Result<Vec<_>, _>>()?;
            *live = joined;
            self.slot = std::mem::replace(&mut self.slot, DrafterSlot::Absent).join(slot);
        }
        let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
        self.members.push(Member { id, prefill_ms, decoding: Instant::now() });
        self.requests.push(request);
        self.rows.push(row);
        Ok(())
    }

    /// One round for every row (draft, verify, accept, commit); `on_event` sees every token as
    /// it is accepted and may stop its row. Returns the rows that finished, which left the batch.
    pub fn round(
        &mut self,
        mut on_event: impl FnMut(Id, Event) -> Flow,
    ) -> Result<Vec<(Id, Generation)>, GenerateError> {
        let mut finished = self.leave_finished()?;
        if !self.members.is_empty() {
            let draft_tokens = self.round_depth();
            let config = SpecConfig { draft_tokens, tree_nodes: self.round_nodes(draft_tokens), ..self.config };
            let batch = Batch {
                model: self.model,
                caches: &self.caches,
                requests: &self.requests,
                config,
                taps: &self.taps,
                active: (0..self.requests.len()).collect(),
            };
            let members = &self.members;
            let (slot, catch_up) = (&mut self.slot, &mut self.catch_up);
            let times = round(&batch, &mut self.rows, slot, catch_up, &mut |r, event| on_event(members[r].id, event))?;
            if let Some(costs) = &mut self.costs {
                costs.record(times.depth, times.draft_ms, times.window_tokens, times.verify_ms, times.branched);
            }
            finished.extend(self.leave_finished()?);
        }
        Ok(finished)
    }

    /// The most tokens a row drafts this round: under `"auto"`, the depth with the most
    /// expected tokens per millisecond for these rows.
    fn round_depth(&self) -> usize {
        let Some(costs) = &self.costs else { return self.most };
        choose_depth(&self.chain_estimates(), self.most, costs)
    }

    /// Each row's acceptance by draft position and the most it may draft.
    fn chain_estimates(&self) -> Vec<([f64; AUTO_MOST], usize)> {
        let rows = self.rows.iter().zip(&self.requests);
        rows.map(|(row, request)| (row.acceptance.estimates(), row.draft_room(request))).collect()
    }

    /// The most drafts of a row's tree this round, `depth` deep: under `"auto"`, as many as
    /// the rows' chances per node rank and the measured costs make pay, and none (chains) where
    /// a chain of that depth is expected to give more tokens per millisecond.
    fn round_nodes(&self, depth: usize) -> usize {
        let most = self.config.tree_nodes;
        let Some(costs) = self.costs.as_ref().filter(|_| most > 0 && depth > 0) else { return most };
        let rows: Vec<Vec<f64>> = self.rows.iter().map(|row| row.nodes.estimates(most)).collect();
        let nodes = choose_nodes(&rows, most, depth, costs);
        let chain = chain_rate(&self.chain_estimates(), depth, costs);
        if tree_rate(&rows, nodes, depth, costs) > chain {
            nodes
        } else {
            0
        }
    }

    /// Removes finished rows from the caches, the drafter and the batch.
    fn leave_finished(&mut self) -> Result<Vec<(Id, Generation)>, GenerateError> {
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| self.rows[r].stop.is_none()).collect();
        if keep.len() == self.rows.len() {
            return Ok(Vec::new());
        }
        if keep.is_empty() {
            // The next row to join starts the batch afresh, with a fresh drafter even after a
            // failure.
            self.caches.borrow_mut().clear();
            self.catch_up.clear();
        } else {
            self.catch_up.flush(&mut self.slot)?;
            for cache in self.caches.borrow_mut().iter_mut() {
                cache.filter_rows(&keep)?;
            }
            let rows: Vec<u32> = keep.iter().map(|&r| r as u32).collect();
            self.slot.call(|g| g.filter_rows(&rows));
        }
        let reason = self.slot.dropped_reason();
        let mut finished = Vec::new();
        for r in (0..self.rows.len()).rev() {
            if self.rows[r].stop.is_some() {
                let member = self.members.remove(r);
                self.requests.remove(r);
                let row = self.rows.remove(r);
                let decode_ms = member.decoding.elapsed().as_secs_f64() * 1e3;
                finished.push((member.id, row.finish(member.prefill_ms, decode_ms, reason.clone())));
            }
        }
        finished.reverse();
        if self.members.is_empty() {
            self.slot = DrafterSlot::Absent;
        }
        Ok(finished)
    }
}
