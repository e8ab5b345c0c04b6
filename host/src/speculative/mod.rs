//! The verify loop: a drafter proposes, the target checks every proposal in one forward, the
//! caches keep exactly the accepted rows. The output is the target's own samples, so it equals
//! plain decoding token for token (greedy, and sampled with the same seed: every position is
//! drawn with the key plain decoding would use for it). With draft probabilities, rejection
//! sampling with residual resampling keeps the target's distribution instead.

use std::cell::RefCell;
use std::rc::Rc;

use mlx_rs::Array;
use plugin_api::{Ports, PrefillMode};

use crate::generate::{check_request, Event, Flow, GenerateError, Generation, Request, Stats, StopReason};
use crate::model::{Gemma4, LayerCache, Taps as LayerTaps};
use crate::plugin::{DrafterError, LoadedDrafter};
use crate::target_view::TargetView;

mod accept;
mod catch_up;
mod depth;
mod live;
mod measure;
mod prefill;
mod prefix_cache;
mod round;
mod slot;
pub mod tree;
mod tree_round;
mod tree_size;

pub use depth::{describe_draft_tokens, AUTO_MOST};
pub use live::LiveBatch;

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
    /// Tokens drafted per round; under `auto`, the most.
    pub draft_tokens: usize,
    pub verify: Verify,
    /// `draft_tokens = "auto"`: each round drafts as deep as its rows' acceptance and the
    /// measured costs make pay ([`depth`]).
    pub auto: bool,
    /// The most nodes of a row's tree of drafts, where the drafter offers trees and the target
    /// verifies them ([`tree_round`]); under `auto`, each round's trees hold as many as pay
    /// ([`tree_size`]). 0: chains.
    pub tree_nodes: usize,
}

impl SpecConfig {
    /// A fixed draft length, chains.
    pub fn new(draft_tokens: usize, verify: Verify) -> SpecConfig {
        SpecConfig { draft_tokens, verify, auto: false, tree_nodes: 0 }
    }
}

/// Opens a drafter against the target without generating: a pairing the drafter refuses, or
/// one the host cannot serve, fails here, before any request.
pub fn probe_open(model: &Rc<Gemma4>, drafter: &LoadedDrafter) -> Result<(), DrafterError> {
    let caches = Rc::new(RefCell::new(Vec::new()));
    let view = TargetView::new(model.clone(), caches, drafter.info.capabilities.ports);
    drafter.open(view.boxed(), 1, model.config.vocab_size as u32)?;
    check_pairing(model, drafter)
}

/// What the host itself needs of a drafter: taps inside the target, a prefill it performs.
fn check_pairing(model: &Gemma4, drafter: &LoadedDrafter) -> Result<(), DrafterError> {
    let caps = &drafter.info.capabilities;
    let layers = model.config.num_hidden_layers as u32;
    let refuse = |reason: String| DrafterError::InvalidAnswer { kind: drafter.kind().to_owned(), call: "open", reason };
    if let Some(bad) = caps.tap_layers.iter().find(|&&l| l > layers) {
        return Err(refuse(format!("tap layer {bad} is beyond the target's {layers} layers (valid: 0..={layers})")));
    }
    if let (Some(group), true) = (model.group, caps.ports.contains(plugin_api::Ports::DONORS)) {
        let reason = format!(
            "it reads the target's KV caches (the `donors` port), which a tensor-parallel target splits by \
             KV head over its {} ranks; run this drafter with an unsharded target",
            group.size
        );
        return Err(DrafterError::Unpaired { kind: drafter.kind().to_owned(), reason });
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
pub fn generate_speculative<R: Into<Flow>>(
    model: &Rc<Gemma4>,
    drafter: &LoadedDrafter,
    request: &Request,
    config: SpecConfig,
    mut on_event: impl FnMut(Event) -> R,
) -> Result<Generation, GenerateError> {
    let requests = std::slice::from_ref(request);
    let mut out = generate_speculative_rows(model, drafter, requests, config, |_, event| on_event(event))?;
    Ok(out.remove(0))
}

/// One request's progress.
struct Row {
    tokens: Vec<u32>,
    /// The last token emitted (or the prompt's last): the head of the row's next window.
    pending: u32,
    stop: Option<StopReason>,
    stats: Stats,
    /// Per draft position: (times drafted, times accepted).
    by_position: Vec<(usize, usize)>,
    /// The same, weighted toward recent rounds, for `"auto"` draft lengths.
    acceptance: depth::Acceptance,
    /// Per node rank of its trees, how often its accepted path went through it.
    nodes: tree_size::NodeAcceptance,
    /// Per token, when the request asks for them.
    logprobs: Vec<crate::sampling::TokenLogprob>,
}

impl Row {
    fn new(request: &Request, draft_tokens: usize) -> Row {
        Row {
            tokens: Vec::new(),
            pending: *request.prompt.last().expect("checked non-empty"),
            stop: (request.max_tokens == 0).then_some(StopReason::MaxTokens),
            stats: Stats { prompt_tokens: request.prompt.len(), ..Stats::default() },
            by_position: vec![(0, 0); draft_tokens],
            acceptance: depth::Acceptance::default(),
            nodes: tree_size::NodeAcceptance::default(),
            logprobs: Vec::new(),
        }
    }

    /// The row's draft length (a request may ask for less than the batch's).
    fn draft_tokens(&self) -> usize {
        self.by_position.len()
    }

    /// The most the row may draft in its next round: its draft length, and no draft that would
    /// pass `max_tokens`.
    fn draft_room(&self, request: &Request) -> usize {
        self.draft_tokens().min(request.max_tokens - self.tokens.len() - 1)
    }

    /// The generation, with the statistics derived from the counts.
    fn finish(self, prefill_ms: f64, decode_ms: f64, drafter_error: Option<String>) -> Generation {
        let mut s = self.stats;
        s.prefill_ms = prefill_ms;
        s.decode_ms = decode_ms;
        s.generated_tokens = self.tokens.len();
        s.drafter_error = drafter_error;
        s.mean_accept_len = if s.rounds == 0 { 0.0 } else { (s.accepted + s.rounds) as f64 / s.rounds as f64 };
        s.acceptance_rate = if s.drafted == 0 { 0.0 } else { s.accepted as f64 / s.drafted as f64 };
        s.accepted_by_position =
            self.by_position.iter().take_while(|(d, _)| *d > 0).map(|&(d, a)| a as f64 / d as f64).collect();
        s.drafted_by_position = self.by_position.iter().map(|&(d, _)| d).take_while(|&d| d > 0).collect();
        s.prefill_tokens_per_s = per_second(s.prompt_tokens, prefill_ms);
        s.decode_tokens_per_s = per_second(self.tokens.len(), decode_ms);
        let stop = self.stop.unwrap_or(StopReason::MaxTokens);
        Generation { tokens: self.tokens, stop, stats: s, logprobs: self.logprobs }
    }
}

/// Generates several requests as rows of one batch: one target forward per round for all
/// rows, each row keeping its own accepted length. Each row's output equals what it would be
/// alone. `on_event(row, event)` sees each row's prefill progress and every token as it is
/// produced; a [`Flow::Stop`] ends that row (during its prefill: once that row's prefill is done).
pub fn generate_speculative_rows<R: Into<Flow>>(
    model: &Rc<Gemma4>,
    drafter: &LoadedDrafter,
    requests: &[Request],
    config: SpecConfig,
    mut on_event: impl FnMut(usize, Event) -> R,
) -> Result<Vec<Generation>, GenerateError> {
    let mut on_event = |row: usize, event: Event| on_event(row, event).into();
    for request in requests {
        check_request(model, request)?;
    }
    let mut batch = LiveBatch::new(model, Some(drafter), config)?;
    for (r, request) in requests.iter().enumerate() {
        batch.join(r, request.clone(), |event| on_event(r, event))?;
    }
    let mut out: Vec<Option<Generation>> = vec![None; requests.len()];
    while !batch.is_empty() {
        for (r, generation) in batch.round(&mut on_event)? {
            out[r] = Some(generation);
        }
    }
    Ok(out.into_iter().map(|g| g.expect("every row finishes")).collect())
}

/// What the drafter reads of each target forward (its `taps` port): nothing, the final hidden
/// states, or the hidden states at its tap layers.
enum Taps {
    None,
    Final,
    Layers(Vec<usize>),
}

impl Taps {
    fn of(drafter: &LoadedDrafter) -> Taps {
        let caps = &drafter.info.capabilities;
        match (caps.ports.contains(Ports::TAPS), caps.tap_layers.is_empty()) {
            (false, _) => Taps::None,
            (true, true) => Taps::Final,
            (true, false) => Taps::Layers(caps.tap_layers.iter().map(|&l| l as usize).collect()),
        }
    }
}

/// The target forward over token ids [rows, length], with the drafter's context: the hidden
/// states at its tap layers concatenated on the feature axis, or the final hidden states.
fn forward(
    model: &Gemma4,
    caches: &mut [LayerCache],
    ids: &Array,
    taps: &Taps,
) -> Result<(Array, Option<Array>), GenerateError> {
    with_context(taps, |t| Ok(model.forward_hidden(ids, caches, t)?))
}

/// `run`'s forward (hidden states, and whatever else it returns) with the drafter's context
/// ([`forward`]).
fn with_context<T>(
    taps: &Taps,
    run: impl FnOnce(Option<&mut LayerTaps>) -> Result<T, GenerateError>,
) -> Result<(T, Option<Array>), GenerateError>
where
    T: Hidden,
{
    let taps = match taps {
        Taps::None => return Ok((run(None)?, None)),
        Taps::Final => {
            let out = run(None)?;
            let hidden = out.hidden().clone();
            return Ok((out, Some(hidden)));
        }
        Taps::Layers(layers) => layers,
    };
    let mut t = LayerTaps { layers: taps.to_vec(), captured: Vec::new() };
    let out = run(Some(&mut t))?;
    // Captured in layer order; the drafter wants them in its tap order.
    let mut layers = taps.to_vec();
    layers.sort_unstable();
    layers.dedup();
    let ordered: Vec<&Array> =
        taps.iter().map(|l| &t.captured[layers.binary_search(l).expect("every tap captured")]).collect();
    let axis = ordered.first().map_or(0, |a| a.ndim().saturating_sub(1));
    Ok((out, Some(plugin_api::nn::layout::concat(&ordered, axis)?)))
}

/// A forward's result, whose final hidden states are the context of a drafter that taps none.
trait Hidden {
    fn hidden(&self) -> &Array;
}

impl Hidden for Array {
    fn hidden(&self) -> &Array {
        self
    }
}

impl<T> Hidden for (Array, T) {
    fn hidden(&self) -> &Array {
        &self.0
    }
}

fn per_second(tokens: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        tokens as f64 / (ms / 1e3)
    } else {
        0.0
    }
}
