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
    Done(Generation),
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
    let drafter = session.drafter.as_ref().map(|(d, _)| d);
    let config =
        session.drafter.as_ref().map_or(SpecConfig { draft_tokens: 0, verify: Verify::Match }, |(_, config)| *config);
    let new_batch = || {
        let batch = LiveBatch::new(&session.model, drafter, config).expect("pairing checked when the session opened");
        batch.with_prefix_cache(prefix_cache_bytes).with_auto_draft_tokens(session.auto_draft_tokens)
    };
    let mut batch = new_batch();
    let mut waiting: HashMap<u64, Job> = HashMap::new();
    let mut next_id = 0u64;
    let mut open = true;
    loop {
        // Intake: block while idle, otherwise take what is waiting, up to the batch limit.
        while open && batch.len() < max_batch {
            let job =
                if batch.is_empty() { jobs.recv().map_err(|_| TryRecvError::Disconnected) } else { jobs.try_recv() };
            match job {
                Ok(job) => {
                    metrics.queue_depth.dec();
                    if job.events.is_closed() {
                        metrics.count("cancelled");
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    let gone = || job.events.is_closed();
                    let depth = job.draft_tokens.unwrap_or(config.draft_tokens);
                    let joined = batch.join_drafting(id, job.request.clone(), depth, |_| {
                        if gone() {
                            Flow::Stop
                        } else {
                            Flow::Continue
                        }
                    });
                    match joined {
                        Ok(()) => {
                            metrics.prefix_cache_bytes.set(batch.prefix_cache_bytes() as i64);
                            waiting.insert(id, job);
                        }
                        Err(e) => {
                            let _ = job.events.send(JobEvent::Failed(e.to_string()));
                        }
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        if batch.is_empty() {
            if !open {
                return;
            }
            continue;
        }
        metrics.batch_size.set(batch.len() as i64);
        let result = batch.round(|id, event| {
            let Event::Token(token) = event else { return Flow::Continue };
            let job = &waiting[&id];
            if job.events.send(JobEvent::Token(token)).is_err() || job.stop.load(Ordering::Relaxed) {
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
                    if job.events.send(JobEvent::Done(generation)).is_err() {
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
