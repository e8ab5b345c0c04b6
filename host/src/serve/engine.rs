//! The engine thread: it owns the target and the drafter (MLX arrays are not shared across
//! threads) and runs one [`LiveBatch`]. Between rounds, waiting requests join the batch (up to
//! `max_batch` rows); each token goes to its request's channel as soon as it is accepted. A
//! request whose client has gone, or which asked to stop, leaves at its next token.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::generate::{Event, Flow, Generation, Request};
use crate::run::{RunError, RunOptions, Session};
use crate::sampling::TokenLogprob;
use crate::speculative::{LiveBatch, SpecConfig, Verify};

/// A request for the engine, with where its tokens go.
pub struct Job {
    pub request: Request,
    pub events: UnboundedSender<JobEvent>,
    /// Set by the server to end the request at its next token (a stop string was found).
    pub stop: Arc<AtomicBool>,
    /// At most this many drafts per round (the server's own when `None`).
    pub draft_tokens: Option<usize>,
}

pub enum JobEvent {
    Token(u32),
    /// The log-probabilities of the token that follows, when the request asks for them.
    Logprob(TokenLogprob),
    Done(Box<Generation>),
    /// The request could not be served (the message says why).
    Failed(String),
}

/// What the server needs of the loaded session, sent once the engine is ready.
#[derive(Clone)]
pub struct Ready {
    pub model_dir: std::path::PathBuf,
    /// A request with the manifest's and the checkpoint's defaults and no prompt yet.
    pub defaults: Request,
    pub context: usize,
    pub vocab: u32,
    pub draft_tokens: Option<usize>,
}

/// What the engine decided between two rounds: the requests that join the batch, in order, and
/// the rows that leave at their next token. A sharded target's ranks all apply the same
/// decisions, made by rank 0 and broadcast, so that their batches stay identical.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Decisions {
    joins: Vec<Joining>,
    leaving: Vec<u64>,
    /// No more requests will come: the engine ends once its batch is empty.
    closing: bool,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Joining {
    id: u64,
    request: Request,
    draft_tokens: usize,
}

/// Loads the session, reports `Ready` (or why it could not load) through `ready`, then serves
/// `jobs` until the channel closes and the batch is empty.
pub fn run(
    options: RunOptions,
    max_batch: usize,
    prefix_cache_bytes: usize,
    jobs: Receiver<Job>,
    ready: std::sync::mpsc::Sender<Result<Ready, RunError>>,
    metrics: Arc<Metrics>,
    warn: impl FnMut(String),
) {
    let session = match Session::open(&options, warn).and_then(|s| ready_of(&s, &options).map(|r| (s, r))) {
        Ok((session, info)) => {
            let _ = ready.send(Ok(info));
            session
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let group = session.model.group;
    let config = config_of(&session);
    let new_batch = || batch_of(&session, config, prefix_cache_bytes);
    let mut batch = new_batch();
    let mut waiting: HashMap<u64, Job> = HashMap::new();
    let mut next_id = 0u64;
    let mut open = true;
    loop {
        // Intake: block while idle, otherwise take what is waiting, up to the batch limit.
        let mut decisions = Decisions::default();
        while open && batch.len() + decisions.joins.len() < max_batch {
            let idle = batch.is_empty() && decisions.joins.is_empty();
            let job = if idle { jobs.recv().map_err(|_| TryRecvError::Disconnected) } else { jobs.try_recv() };
            match job {
                Ok(job) => {
                    metrics.queue_depth.dec();
                    if job.events.is_closed() {
                        metrics.count("cancelled");
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    let draft_tokens = job.draft_tokens.unwrap_or(config.draft_tokens);
                    decisions.joins.push(Joining { id, request: job.request.clone(), draft_tokens });
                    waiting.insert(id, job);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        decisions.closing = !open && batch.is_empty() && decisions.joins.is_empty();
        if let Some(group) = group {
            // Ranks cannot stop a row in the middle of a round on their own: a request whose
            // client left or that found a stop string leaves at its next token, on every rank.
            decisions.leaving = waiting
                .iter()
                .filter(|(_, job)| job.events.is_closed() || job.stop.load(Ordering::Relaxed))
                .map(|(&id, _)| id)
                .collect();
            if let Err(e) = share(group, &mut decisions) {
                for (_, job) in waiting.drain() {
                    let _ = job.events.send(JobEvent::Failed(e.clone()));
                }
                return;
            }
        }
        if decisions.closing {
            return;
        }
        for joining in decisions.joins {
            let job = &waiting[&joining.id];
            let gone = || group.is_none() && job.events.is_closed();
            let flow = |_: Event| if gone() { Flow::Stop } else { Flow::Continue };
            match batch.join_drafting(joining.id, joining.request, joining.draft_tokens, flow) {
                Ok(()) => {
                    metrics.prefix_cache_bytes.set(batch.prefix_cache_bytes() as i64);
                }
                Err(e) => {
                    let job = waiting.remove(&joining.id).expect("a joining row has its job");
                    let _ = job.events.send(JobEvent::Failed(e.to_string()));
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        metrics.batch_size.set(batch.len() as i64);
        let result = batch.round(|id, event| {
            let token = match event {
                Event::Token(token) => token,
                Event::Logprob(l) => {
                    let _ = waiting[&id].events.send(JobEvent::Logprob(l));
                    return Flow::Continue;
                }
                Event::Prefill { .. } => return Flow::Continue,
            };
            let job = &waiting[&id];
            let delivered = job.events.send(JobEvent::Token(token)).is_ok();
            let stop = decisions.leaving.contains(&id)
                || (group.is_none() && (!delivered || job.stop.load(Ordering::Relaxed)));
            if stop {
                Flow::Stop
            } else {
                Flow::Continue
            }
        });
        match result {
            Ok(finished) => {
                for (id, generation) in finished {
                    let job = waiting.remove(&id).expect("every row has its job");
                    metrics.finished(&generation.stats);
                    if job.events.send(JobEvent::Done(Box::new(generation))).is_err() {
                        metrics.count("cancelled");
                    }
                }
            }
            Err(e) => {
                // The batch is lost (the target itself failed): every request in it fails.
                for (_, job) in waiting.drain() {
                    let _ = job.events.send(JobEvent::Failed(e.to_string()));
                }
                batch = new_batch();
            }
        }
        // Memory first: a reader that sees the batch empty sees the memory of an empty batch.
        metrics.active_memory_bytes.set(crate::runtime::active_memory() as i64);
        metrics.batch_size.set(batch.len() as i64);
    }
}

/// A rank other than 0 of a sharded target: it serves no HTTP, and runs the same batch as rank
/// 0 by applying the decisions rank 0 broadcasts before each round, until rank 0 closes.
pub fn follow(options: RunOptions, prefix_cache_bytes: usize) -> Result<(), super::ServeError> {
    let session = Session::open(&options, |_| {})?;
    let group = session.model.group.expect("a follower is a rank of a sharded target");
    let config = config_of(&session);
    let new_batch = || batch_of(&session, config, prefix_cache_bytes);
    let mut batch = new_batch();
    loop {
        let mut decisions = Decisions::default();
        share(group, &mut decisions).map_err(super::ServeError::Ranks)?;
        if decisions.closing {
            return Ok(());
        }
        for joining in decisions.joins {
            // A request the leader could not join fails here alike; the leader reports it.
            let _ = batch.join_drafting(joining.id, joining.request, joining.draft_tokens, |_| Flow::Continue);
        }
        if batch.is_empty() {
            continue;
        }
        let leaving = &decisions.leaving;
        if batch.round(|id, _| if leaving.contains(&id) { Flow::Stop } else { Flow::Continue }).is_err() {
            batch = new_batch();
        }
    }
}

/// Rank 0's decisions on every rank.
fn share(group: &crate::distributed::Group, decisions: &mut Decisions) -> Result<(), String> {
    let bytes = serde_json::to_vec(&*decisions).expect("decisions serialize");
    let shared = group.broadcast(&bytes).map_err(|e| format!("sharing the batch with the other ranks: {e}"))?;
    *decisions = serde_json::from_slice(&shared).map_err(|e| format!("rank 0's decisions: {e}"))?;
    Ok(())
}

fn config_of(session: &Session) -> SpecConfig {
    session.drafter.as_ref().map_or(SpecConfig::new(0, Verify::Match), |(_, config)| *config)
}

fn batch_of(session: &Session, config: SpecConfig, prefix_cache_bytes: usize) -> LiveBatch<'_, u64> {
    let drafter = session.drafter.as_ref().map(|(d, _)| d);
    let batch = LiveBatch::new(&session.model, drafter, config).expect("pairing checked when the session opened");
    batch.with_prefix_cache(prefix_cache_bytes)
}

fn ready_of(session: &Session, options: &RunOptions) -> Result<Ready, RunError> {
    let overrides = crate::run::Overrides { prompt_ids: Some(vec![0]), ..options.overrides.clone() };
    let mut defaults = session.request(&overrides)?;
    defaults.prompt.clear();
    Ok(Ready {
        model_dir: session.manifest.target_model.clone(),
        defaults,
        context: session.model.config.max_position_embeddings,
        vocab: session.model.config.vocab_size as u32,
        draft_tokens: session.drafter.as_ref().map(|(_, c)| c.draft_tokens),
    })
}
