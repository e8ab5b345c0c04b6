//! Speculative decoding is lossless: its output equals plain decoding token for token, greedy
//! and sampled, whatever the drafter proposes, across many wraps of the sliding window; with
//! rejection sampling the emitted tokens follow the target's distribution.

mod common;

use std::path::{Path, PathBuf};
use std::rc::Rc;

use host::generate::{generate, Generation, Request};
use host::model::{load, Gemma4};
use host::plugin::load::load as load_library;
use host::plugin::LoadedDrafter as HostDrafter;
use host::sampling::{filtered_logprobs, Penalties, SamplingParams};
use host::speculative::{generate_speculative, SpecConfig, Verify};
use mlx_rs::Array;
use plugin_api::abi::{RowState, TokenRows};
use plugin_api::sdk::{self, DraftProvider, Drafter, GroupedDraftProvider, Options, Proposal, Target};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

use common::mix;

fn fixture(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4").join(name);
    assert!(dir.join("config.json").exists(), "{} is missing: run `make oracle`", dir.display());
    dir
}

fn model(name: &str) -> Rc<Gemma4> {
    host::runtime::init();
    Rc::new(load(&fixture(name)).unwrap())
}

const PROMPT: [u32; 12] = [2, 17, 40, 9, 33, 17, 40, 9, 61, 5, 17, 40];

fn request(max_tokens: usize, sampling: SamplingParams) -> Request {
    Request { prompt: PROMPT.to_vec(), max_tokens, sampling, ..Default::default() }
}

fn greedy() -> SamplingParams {
    SamplingParams::default()
}

/// Every penalty and a logit bias, strong enough to change what the test targets generate.
fn penalties() -> Penalties {
    Penalties {
        frequency_penalty: 0.6,
        presence_penalty: 0.3,
        repetition_penalty: 1.4,
        repetition_context_size: 6,
        logit_bias: vec![(17, -4.0), (40, 2.0)],
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, min_p: 0.0, seed }
}

// --- an adversarial drafter: right for a random number of positions, then wrong ----------

struct Adversary;
struct AdversaryProvider {
    seed: u64,
    vocab_guard: u32,
    /// The plain output the adversary peeks at.
    script: Vec<u32>,
    faithful: bool,
}
struct AdversaryRows {
    seed: u64,
    vocab: u32,
    rows: usize,
    script: Vec<u32>,
    faithful: bool,
}

impl Drafter for Adversary {
    type Provider = AdversaryProvider;
    fn descriptor() -> Descriptor {
        Descriptor::new("adversary", "adversarial test drafter", "0.0.0")
            .option("seed", "0", "")
            .option("max_token", "0", "largest id proposed, 0 = the vocabulary's")
            .option("script", "[]", "the plain output, which the adversary copies in part")
            .option("faithful", "false", "copy the script in full, as deep as asked")
    }
    fn load(_: Option<&Path>, o: &Options) -> Result<AdversaryProvider, PluginError> {
        Ok(AdversaryProvider {
            seed: o.value("seed")?,
            vocab_guard: o.value("max_token")?,
            script: o.value("script")?,
            faithful: o.value("faithful")?,
        })
    }
}

impl DraftProvider for AdversaryProvider {
    type Rows = AdversaryRows;
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "adversary".into(),
            weights_bytes: 0,
            namespace: "adversary".into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }
    fn open(&self, target: Target, rows: usize) -> Result<AdversaryRows, PluginError> {
        let vocab = if self.vocab_guard > 0 { self.vocab_guard } else { target.info().vocab_size };
        let script = self.script.clone();
        Ok(AdversaryRows { seed: self.seed, vocab, rows, script, faithful: self.faithful })
    }
}

impl GroupedDraftProvider for AdversaryRows {
    fn prefill(&mut self, _: TokenRows<'_>, _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn draft(&mut self, pending: &[u32], depth: usize, steps: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        Ok(steps
            .iter()
            .take(pending.len())
            .map(|&step| {
                let r = mix(self.seed ^ mix(step));
                let len = if self.faithful { depth } else { (r % (depth as u64 + 1)) as usize }; // 0..=depth
                let right = if self.faithful { len } else { ((r >> 8) % (len as u64 + 1)) as usize };
                let tokens = (0..len)
                    .map(|i| match self.script.get(step as usize + i) {
                        Some(&t) if i < right => t,
                        _ => (mix(r ^ i as u64) % self.vocab as u64) as u32,
                    })
                    .collect();
                Proposal::tokens(tokens)
            })
            .collect())
    }
    fn commit(&mut self, _: TokenRows<'_>, _: &[u32], _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
        self.rows = keep.len();
        Ok(())
    }
    fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
        self.rows += states.len();
        Ok(())
    }
    fn capture(&mut self, _: usize) -> Result<RowState, PluginError> {
        Ok(RowState {
            namespace: "adversary".into(),
            processed: 0,
            ids: Default::default(),
            tensors: Default::default(),
        })
    }
}

fn adversary(seed: u64, script: &[u32]) -> HostDrafter {
    let options = format!("seed = {seed}\nscript = {script:?}");
    HostDrafter::load_root(sdk::root_module::<Adversary>(), "adversary", None, &options).unwrap()
}

/// The trained bfloat16 demo target and its tokenizer.
fn demo_target() -> (Rc<Gemma4>, host::tokenizer::Tokenizer) {
    host::runtime::init();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/kjv-gemma4");
    (Rc::new(load(&dir).unwrap()), host::tokenizer::Tokenizer::load(&dir).unwrap())
}

fn ngram() -> HostDrafter {
    let plugin = load_library(&common::workspace_plugin("ngram"), None).unwrap();
    HostDrafter::load(&plugin, None, "max_ngram = 3").unwrap()
}

fn spec(model: &Rc<Gemma4>, drafter: &HostDrafter, request: &Request, gamma: usize) -> Generation {
    let config = SpecConfig::new(gamma, Verify::Match);
    generate_speculative(model, drafter, request, config, |_| {}).unwrap()
}

fn plain(model: &Gemma4, request: &Request) -> Vec<u32> {
    generate(model, request, |_| {}).unwrap().tokens
}

const GAMMAS: [usize; 4] = [1, 2, 4, 7];
/// Far past the fixtures' sliding windows (8–16 tokens): several wraps.
const LONG: usize = 80;

#[test]
fn greedy_with_ngram_equals_plain_greedy() {
    for fixture in ["dense", "ple-kvshare", "kv-eq"] {
        let m = model(fixture);
        let r = request(LONG, greedy());
        let expected = plain(&m, &r);
        for gamma in GAMMAS {
            let g = spec(&m, &ngram(), &r, gamma);
            assert_eq!(g.tokens, expected, "{fixture}, γ = {gamma}");
            assert!(g.stats.drafter_error.is_none());
        }
    }
}

/// Penalties and a logit bias move each position by the tokens before it: a verify window
/// applies to each of its positions exactly its prefix's, so output equals plain decoding's
/// with the same settings, greedy and sampled, whatever the drafts.
#[test]
fn penalties_and_bias_under_speculation_equal_plain_decoding() {
    let m = model("dense");
    for sampling in [greedy(), sampled(11)] {
        let r = Request { penalties: penalties(), ..request(LONG, sampling) };
        let expected = plain(&m, &r);
        assert_ne!(expected, plain(&m, &request(LONG, sampling)), "the penalties change the output");
        for drafter in [ngram(), adversary(5, &expected)] {
            for gamma in [1, 4] {
                let g = spec(&m, &drafter, &r, gamma);
                assert_eq!(g.tokens, expected, "{}, γ = {gamma}, {sampling:?}", drafter.kind());
                // The adversary copies the output in part: windows with drafts kept past their first
                // position, whose later positions see penalties from the drafts before them.
                if drafter.kind() == "adversary" && gamma > 1 {
                    assert!(g.stats.accepted_by_position.get(1).is_some_and(|&a| a > 0.0), "{:?}", g.stats);
                }
            }
        }
    }
}

/// Log-probabilities reported under speculation are the target's at each position, as plain
/// decoding reports them, greedy and sampled, with and without penalties: within 1e-4 on the
/// CPU loops' route, whose verify windows compute each position as a decode step does; within
/// float rounding on MLX's route (1.2e-3 measured on this fixture), as on a GPU.
#[test]
fn logprobs_under_speculation_equal_plain_decodings() {
    let m = model("dense");
    let tolerance = if kernels::route::on_cpu() { 1e-4 } else { 1e-2 };
    for sampling in [greedy(), sampled(11)] {
        for penalized in [false, true] {
            let mut r = Request { logprobs: Some(5), ..request(40, sampling) };
            if penalized {
                r.penalties = penalties();
            }
            let plain = generate(&m, &r, |_| {}).unwrap();
            assert_eq!(plain.logprobs.len(), plain.tokens.len());
            for (l, &t) in plain.logprobs.iter().zip(&plain.tokens) {
                assert_eq!(l.token, t);
                assert_eq!(l.top.len(), 5);
                assert!(l.logprob <= 0.0 && l.top.windows(2).all(|w| w[0].1 >= w[1].1), "{l:?}");
                if sampling.is_greedy() {
                    assert_eq!((l.top[0].0, l.top[0].1), (t, l.logprob), "greedy takes the most likely");
                }
            }
            for drafter in [ngram(), adversary(5, &plain.tokens)] {
                let g = spec(&m, &drafter, &r, 4);
                assert_eq!(g.tokens, plain.tokens, "{}", drafter.kind());
                for (a, b) in g.logprobs.iter().zip(&plain.logprobs) {
                    assert_eq!((a.token, a.top.len()), (b.token, b.top.len()));
                    assert!((a.logprob - b.logprob).abs() < tolerance, "{a:?} {b:?}");
                    for (x, y) in a.top.iter().zip(&b.top) {
                        assert!(x.0 == y.0 && (x.1 - y.1).abs() < tolerance, "{a:?} {b:?}");
                    }
                }
                assert_eq!(g.logprobs.len(), plain.logprobs.len());
            }
        }
    }
}

#[test]
fn greedy_with_an_adversary_equals_plain_greedy() {
    for fixture in ["dense", "ple-kvshare", "moe"] {
        let m = model(fixture);
        let r = request(LONG, greedy());
        let expected = plain(&m, &r);
        for gamma in GAMMAS {
            for seed in 0..3 {
                let g = spec(&m, &adversary(seed, &expected), &r, gamma);
                assert_eq!(g.tokens, expected, "{fixture}, γ = {gamma}, seed {seed}");
                let s = &g.stats;
                assert!(
                    s.accepted > 0 && s.accepted < s.drafted,
                    "{fixture} γ {gamma}: the adversary must be partly right: {s:?}"
                );
                assert_eq!(s.target_forwards, s.rounds + 1, "one forward per round after the prefill");
            }
        }
    }
}

#[test]
fn sampled_speculation_equals_plain_sampling_for_the_same_seed() {
    let m = model("dense");
    for seed in [1, 7] {
        let r = request(LONG, sampled(seed));
        let expected = plain(&m, &r);
        for gamma in GAMMAS {
            assert_eq!(spec(&m, &ngram(), &r, gamma).tokens, expected, "ngram, seed {seed}, γ = {gamma}");
            assert_eq!(
                spec(&m, &adversary(seed, &expected), &r, gamma).tokens,
                expected,
                "adversary, seed {seed}, γ = {gamma}"
            );
        }
    }
}

#[test]
fn eos_is_never_content_even_as_an_accepted_draft() {
    let m = model("dense");
    let free = plain(&m, &request(40, greedy()));
    // Make the 10th generated token the end of sequence: both must stop before it.
    let eos = free[9];
    let first = free.iter().position(|&t| t == eos).unwrap();
    let r = Request { eos: vec![eos], ..request(40, greedy()) };
    let expected = plain(&m, &r);
    assert_eq!(expected, free[..first]);
    for gamma in GAMMAS {
        // The adversary proposes the true continuation, EOS included, so EOS arrives as an
        // accepted draft in some rounds.
        let g = spec(&m, &adversary(3, &free), &r, gamma);
        assert_eq!(g.tokens, expected, "γ = {gamma}");
        assert!(!g.tokens.contains(&eos));
    }
}

#[test]
fn max_tokens_is_exact() {
    let m = model("dense");
    for max in [0, 1, 2, 3, 9, 17] {
        let r = request(max, greedy());
        let expected = plain(&m, &r);
        assert_eq!(expected.len(), max);
        for gamma in GAMMAS {
            assert_eq!(spec(&m, &adversary(1, &expected), &r, gamma).tokens, expected, "max {max}, γ {gamma}");
        }
    }
}

#[test]
fn a_drafter_that_panics_mid_request_leaves_a_complete_correct_output() {
    let m = model("dense");
    let r = request(LONG, greedy());
    let expected = plain(&m, &r);
    let plugin = load_library(&common::fixture("misbehaving"), None).unwrap();
    let drafter = HostDrafter::load(&plugin, None, "mode = \"well-behaved\"\npanic_after = 3").unwrap();
    let g = spec(&m, &drafter, &r, 4);
    assert_eq!(g.tokens, expected);
    let why = g.stats.drafter_error.expect("the drop is reported");
    assert!(why.contains("panicked in draft"), "{why}");
    assert_eq!(g.stats.drafted, 3, "three one-token drafts before the panic");
}

#[test]
fn a_drafter_answering_out_of_contract_is_dropped_not_trusted() {
    let m = model("dense");
    let r = request(30, greedy());
    let expected = plain(&m, &r);
    let plugin = load_library(&common::fixture("misbehaving"), None).unwrap();
    for mode in ["too-many", "out-of-vocab"] {
        let drafter = HostDrafter::load(&plugin, None, &format!("mode = \"{mode}\"")).unwrap();
        let g = spec(&m, &drafter, &r, 3);
        assert_eq!(g.tokens, expected, "{mode}");
        assert!(g.stats.drafter_error.as_deref().unwrap().contains("answered draft wrongly"), "{mode}");
        assert_eq!(g.stats.drafted, 0);
    }
}

#[test]
fn stats_count_what_happened() {
    let m = model("dense");
    let r = request(LONG, greedy());
    let expected = plain(&m, &r);
    let g = spec(&m, &adversary(2, &expected), &r, 4);
    let s = &g.stats;
    assert_eq!(s.generated_tokens, LONG);
    // Every round emits its accepted drafts plus one token of the target's own.
    assert_eq!(s.accepted + s.rounds, LONG);
    assert!((s.mean_accept_len - LONG as f64 / s.rounds as f64).abs() < 1e-9);
    assert!((s.acceptance_rate - s.accepted as f64 / s.drafted as f64).abs() < 1e-9);
    assert_eq!(s.accepted_by_position.len(), 4);
    assert!(
        s.accepted_by_position.windows(2).all(|w| w[0] >= w[1] - 1e-9),
        "acceptance cannot rise with position: {:?}",
        s.accepted_by_position
    );
    // Drafting and verifying are parts of the rounds, which are part of decoding.
    assert!(s.draft_ms > 0.0 && s.verify_ms > 0.0, "{} ms drafting, {} ms verifying", s.draft_ms, s.verify_ms);
    assert!(
        s.draft_ms + s.verify_ms <= s.decode_ms,
        "{} + {} ms of {} ms decoding",
        s.draft_ms,
        s.verify_ms,
        s.decode_ms
    );
}

// --- rejection sampling keeps the target's distribution --------------------------------

/// Proposes one token per row from a fixed distribution q over its `candidates`, returning q.
struct Proposer {
    candidates: Vec<u32>,
}
struct ProposerRows {
    vocab: u32,
    candidates: Vec<u32>,
    /// A different stream for every group, so that batches do not repeat each other's draws.
    draws: u64,
}

static OPENED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// q over the candidates: unlike the target's p, and with mass on a token p never emits.
const Q: [f32; 5] = [0.40, 0.10, 0.10, 0.15, 0.25];

impl Drafter for Proposer {
    type Provider = Proposer;
    fn descriptor() -> Descriptor {
        Descriptor::new("proposer", "fixed-distribution test drafter", "0.0.0")
            .capabilities(Capabilities { draft_probabilities: true, ..Capabilities::default() })
            .option("candidates", "", "the tokens drawn from, one per entry of q")
    }
    fn load(_: Option<&Path>, o: &Options) -> Result<Proposer, PluginError> {
        Ok(Proposer { candidates: o.value("candidates")? })
    }
}

impl DraftProvider for Proposer {
    type Rows = ProposerRows;
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "proposer".into(),
            weights_bytes: 0,
            namespace: "proposer".into(),
            trained_depth: 0,
            capabilities: Capabilities { draft_probabilities: true, ..Capabilities::default() },
        }
    }
    fn open(&self, target: Target, _rows: usize) -> Result<ProposerRows, PluginError> {
        let candidates = self.candidates.clone();
        Ok(ProposerRows {
            vocab: target.info().vocab_size,
            draws: mix(candidates[0] as u64 + OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
            candidates,
        })
    }
}

impl GroupedDraftProvider for ProposerRows {
    fn prefill(&mut self, _: TokenRows<'_>, _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn draft(&mut self, pending: &[u32], _depth: usize, steps: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        let mut probs = vec![0f32; self.vocab as usize];
        for (&t, &q) in self.candidates.iter().zip(&Q) {
            probs[t as usize] = q;
        }
        Ok((0..pending.len())
            .map(|row| {
                let u = (mix(steps[row] ^ mix(row as u64 ^ self.draws)) >> 11) as f32 / (1u64 << 53) as f32;
                let mut acc = 0.0;
                let pick = Q.iter().position(|&q| {
                    acc += q;
                    u < acc
                });
                let token = self.candidates[pick.unwrap_or(Q.len() - 1)];
                Proposal {
                    tokens: vec![token],
                    probabilities: Some(Array::from_slice(&probs, &[1, self.vocab as i32])),
                }
            })
            .collect())
    }
    fn commit(&mut self, _: TokenRows<'_>, _: &[u32], _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn filter_rows(&mut self, _: &[u32]) -> Result<(), PluginError> {
        Ok(())
    }
    fn append(&mut self, _: Vec<RowState>) -> Result<(), PluginError> {
        Ok(())
    }
    fn capture(&mut self, _: usize) -> Result<RowState, PluginError> {
        Ok(RowState {
            namespace: "proposer".into(),
            processed: 0,
            ids: Default::default(),
            tensors: Default::default(),
        })
    }
}

#[test]
fn rejection_sampling_emits_the_targets_distribution() {
    let m = model("dense");
    // Temperature 1 over the top 4 tokens: p has 4 outcomes.
    let params = |seed| SamplingParams { temperature: 1.0, top_k: 4, top_p: 1.0, min_p: 0.0, seed };
    let lp = filtered_logprobs(&first_token_logits(&m), &params(0));
    let p: Vec<(usize, f64)> =
        lp.iter().enumerate().filter(|(_, x)| x.is_finite()).map(|(i, &x)| (i, (x as f64).exp())).collect();
    let total: f64 = p.iter().map(|(_, x)| x).sum();
    assert_eq!(p.len(), 4);
    let outside = (0..m.config.vocab_size as usize).find(|t| !p.iter().any(|(i, _)| i == t)).unwrap();
    let candidates: Vec<u32> = p.iter().map(|&(t, _)| t as u32).chain([outside as u32]).collect();
    let options = format!("candidates = {candidates:?}");
    let drafter = HostDrafter::load_root(sdk::root_module::<Proposer>(), "proposer", None, &options).unwrap();

    // Batches of rows, one seed per row: the first token of each row is one draw.
    let (batches, rows) = (8u64, 150u64);
    let mut counts = std::collections::BTreeMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for batch in 0..batches {
        let requests: Vec<Request> = (0..rows)
            .map(|r| Request {
                prompt: PROMPT.to_vec(),
                max_tokens: 2,
                sampling: params(batch * rows + r),
                ..Default::default()
            })
            .collect();
        let config = SpecConfig::new(1, Verify::Rejection);
        for g in host::speculative::generate_speculative_rows(&m, &drafter, &requests, config, |_, _| {}).unwrap() {
            *counts.entry(g.tokens[0] as usize).or_insert(0u64) += 1;
            drafted += g.stats.drafted;
            accepted += g.stats.accepted;
            assert!(g.stats.drafter_error.is_none(), "{:?}", g.stats.drafter_error);
        }
    }
    let runs = batches * rows;
    assert!(accepted > 0 && accepted < drafted, "both acceptance and resampling must occur: {accepted} of {drafted}");
    // Any token outside p's support is a failure by itself; then a chi-square goodness of fit
    // with 3 degrees of freedom, whose critical value at significance 0.001 is 16.27.
    let strays: u64 = counts.iter().filter(|(t, _)| !p.iter().any(|(i, _)| i == *t)).map(|(_, c)| c).sum();
    assert_eq!(strays, 0, "tokens outside the target's support: {counts:?}");
    let chi2: f64 = p
        .iter()
        .map(|(t, w)| {
            let expected = runs as f64 * w / total;
            let seen = *counts.get(t).unwrap_or(&0) as f64;
            (seen - expected).powi(2) / expected
        })
        .sum();
    assert!(chi2 < 16.27, "chi2 = {chi2:.2}: counts {counts:?}, p {p:?}");
}

#[test]
fn four_rows_in_one_batch_equal_four_single_runs() {
    let m = model("ple-kvshare");
    let prompts: [Vec<u32>; 4] = [
        PROMPT.to_vec(),
        PROMPT[..5].to_vec(),
        vec![7, 7, 7, 7, 7, 7, 7, 7, 7, 9, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
        vec![3],
    ];
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.clone(),
            max_tokens: 30 + 17 * i,
            sampling: if i % 2 == 0 { greedy() } else { sampled(i as u64) },
            ..Default::default()
        })
        .collect();
    for gamma in [2, 4] {
        let drafter = ngram();
        let config = SpecConfig::new(gamma, Verify::Match);
        let batched = host::speculative::generate_speculative_rows(&m, &drafter, &requests, config, |_, _| {}).unwrap();
        for (i, (request, together)) in requests.iter().zip(&batched).enumerate() {
            let alone = spec(&m, &drafter, request, gamma);
            assert_eq!(together.tokens, alone.tokens, "row {i}, γ = {gamma}");
            assert_eq!(together.tokens, plain(&m, request), "row {i}, γ = {gamma}: and both equal plain decoding");
            assert!(together.stats.drafter_error.is_none());
        }
    }
}

/// Continuous batching: rows join a running batch between rounds and leave when they finish
/// (one is cancelled mid-flight), some of them with penalties and a logit bias; each row's
/// output equals its plain decoding, with the ngram drafter and with none.
#[test]
fn rows_joining_and_leaving_mid_flight_equal_single_runs() {
    let requests: Vec<Request> = (0..5)
        .map(|i| Request {
            prompt: PROMPT[..4 + 2 * i].to_vec(),
            max_tokens: 20 + 9 * i,
            sampling: if i % 2 == 0 { greedy() } else { sampled(40 + i as u64) },
            penalties: if i % 3 == 1 { penalties() } else { Default::default() },
            ..Default::default()
        })
        .collect();
    common::join_and_leave_mid_flight(&model("ple-kvshare"), &requests, &ngram(), SpecConfig::new(3, Verify::Match));
}

/// The same on the bfloat16 demo target, where every row's logits must also not depend on the
/// other rows: their lengths decide how many masked slots a row's attention runs over.
#[test]
fn rows_joining_and_leaving_mid_flight_on_the_bfloat16_demo_target_equal_single_runs() {
    let (m, tokenizer) = demo_target();
    let text = "And he entered again into the synagogue; and there was a man there which had a withered \
                hand.\nAnd they watched him, whether he would heal him on the sabbath day; that they might \
                accuse him.\nAnd he saith unto the man which had the withered hand, Stand forth.\n";
    let tokens = tokenizer.encode(text).unwrap();
    let requests: Vec<Request> = (0..5)
        .map(|i| Request {
            prompt: tokens[..12 + 9 * i].to_vec(),
            max_tokens: 40 + 11 * i,
            sampling: if i % 2 == 0 { greedy() } else { sampled(40 + i as u64) },
            penalties: if i % 3 == 1 { penalties() } else { Default::default() },
            ..Default::default()
        })
        .collect();
    common::join_and_leave_mid_flight(&m, &requests, &ngram(), SpecConfig::new(3, Verify::Match));
}

/// `draft_tokens = "auto"`: every round chooses its depth from the rows' acceptance and the
/// measured costs, and the output stays plain decoding's, alone and with rows sharing rounds.
/// A drafter that is always right drafts deeper than the 4 tokens of the fixed default.
#[test]
fn auto_draft_tokens_draft_deep_where_drafts_are_kept() {
    use host::generate::Flow;
    use host::speculative::{LiveBatch, AUTO_MOST};
    let m = model("dense");
    let r = request(60, greedy());
    let expected = plain(&m, &r);
    let faithful = HostDrafter::load_root(
        sdk::root_module::<Adversary>(),
        "adversary",
        None,
        &format!("script = {expected:?}\nfaithful = true"),
    )
    .unwrap();
    let config = SpecConfig { auto: true, ..SpecConfig::new(AUTO_MOST, Verify::Match) };
    for (drafter, name) in [(&ngram(), "ngram"), (&adversary(3, &expected), "adversary"), (&faithful, "faithful")] {
        for rows in [1, 3] {
            let mut batch = LiveBatch::new(&m, Some(drafter), config).unwrap();
            for i in 0..rows {
                batch.join(i, r.clone(), |_| Flow::Continue).unwrap();
            }
            let mut done = Vec::new();
            while !batch.is_empty() {
                done.extend(batch.round(|_, _| Flow::Continue).unwrap());
            }
            assert_eq!(done.len(), rows);
            for (_, g) in done {
                assert_eq!(g.tokens, expected, "{name}, {rows} rows");
                let drafted = &g.stats.drafted_by_position;
                assert!(drafted.len() <= AUTO_MOST, "{name}: {drafted:?}");
                if name == "faithful" && rows == 1 {
                    assert!(drafted.len() > 4, "{name}: drafted by position {drafted:?}");
                }
            }
        }
    }
}

/// The prefix cache: a prompt that extends an earlier one (past the sliding window) prefills
/// only its new tokens, restoring the earlier prompt's caches and drafter row, and its output
/// equals plain decoding, greedy and sampled, with the ngram drafter and with none.
#[test]
fn a_prompt_extending_a_cached_one_gives_the_same_output() {
    use host::generate::Flow;
    use host::speculative::LiveBatch;
    let (m, tokenizer) = demo_target();
    let verses = "And Abraham journeyed from thence toward the south country, and dwelled between Kadesh \
                  and Shur, and sojourned in Gerar.\nAnd Abraham said of Sarah his wife, She is my sister: \
                  and Abimelech king of Gerar sent, and took Sarah.\nBut God came to Abimelech in a dream by \
                  night, and said to him, Behold, thou art but a dead man, for the woman which thou hast \
                  taken; for she is a man's wife.\nBut Abimelech had not come near her: and he said, LORD, \
                  wilt thou slay also a righteous nation?\nSaid he not unto me, She is my sister? and she, even \
                  she herself said, He is my brother: in the integrity of my heart and innocency of my hands \
                  have I done this.\nAnd God said unto him in a dream, Yea, I know that thou didst this in \
                  the integrity of thy heart.\n";
    let first = tokenizer.encode(verses).unwrap();
    let window = 128;
    assert!(first.len() > window + 8, "{}", first.len());
    let mut longer = first.clone();
    longer.extend(tokenizer.encode_rendered("Now therefore restore the man his wife; for he is a prophet").unwrap());
    let drafter = ngram();
    for with_drafter in [true, false] {
        for sampling in [greedy(), sampled(3)] {
            let config = SpecConfig::new(3, Verify::Match);
            let mut batch =
                LiveBatch::new(&m, with_drafter.then_some(&drafter), config).unwrap().with_prefix_cache(64 << 20);
            let mut outputs = Vec::new();
            for (i, prompt) in [&first, &longer].into_iter().enumerate() {
                let request = Request { prompt: prompt.clone(), max_tokens: 40, sampling, ..Default::default() };
                batch.join(i, request.clone(), |_| Flow::Continue).unwrap();
                let mut done = Vec::new();
                while !batch.is_empty() {
                    done.extend(batch.round(|_, _| Flow::Continue).unwrap());
                }
                let (_, g) = done.pop().unwrap();
                let context = format!("prompt {i}, drafter {with_drafter}, {sampling:?}");
                assert_eq!(g.tokens, plain(&m, &request), "{context}");
                outputs.push(g);
            }
            assert_eq!(outputs[0].stats.cached_prompt_tokens, 0);
            assert_eq!(outputs[1].stats.cached_prompt_tokens, first.len() - 1, "the whole first prefill was reused");
            assert!(outputs[1].stats.drafter_error.is_none());
            assert!(batch.prefix_cache_bytes() > 0);
        }
    }
}

/// The target's logits for the first generated token of PROMPT.
fn first_token_logits(m: &Gemma4) -> Vec<f32> {
    let mut caches = m.make_caches(1, 2);
    let ids = Array::from_slice(&PROMPT.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, PROMPT.len() as i32]);
    let hidden = m.forward_hidden(&ids, &mut caches, None).unwrap();
    let logits = host::generate::last_logits(m, &hidden).unwrap().as_dtype(mlx_rs::Dtype::Float32).unwrap();
    logits.as_slice::<f32>().to_vec()
}

/// On a half-precision target a row's logits must not depend on how many rows share the
/// forward, nor on how many masked cache slots surround its keys: rounding to bfloat16 tips
/// close argmaxes, and a verify window of γ + 1 rows must give the tokens that one-row decode
/// steps and a many-row prefill give, also once the sliding window (128) has wrapped.
#[test]
fn greedy_speculation_on_the_bfloat16_demo_target_equals_plain_greedy() {
    let (m, tokenizer) = demo_target();
    // Held-out chapters' openings. The first is longer than a wide product (32 rows); on the
    // second, plain decoding meets an exact tie of the two best logits at its seventh token; the
    // third met a near tie that a ring of another capacity summed differently (position 187).
    let openings = [
        "And Abraham journeyed from thence toward the south country, and dwelled between Kadesh \
         and Shur, and sojourned in Gerar.\nAnd Abraham said of Sarah his wife, She is my sister:",
        "Why do the heathen rage, and the people imagine a vain thing?\nThe kings of the earth set \
         themselves, and the rulers take counsel together, against the LORD, and against his anointed, saying,\n",
        "And he entered again into the synagogue; and there was a man there which had a withered hand.\n\
         And they watched him, whether he would heal him on the sabbath day; that they might accuse him.\n",
    ];
    for text in openings {
        let prompt = tokenizer.encode(text).unwrap();
        assert!(prompt.len() > 32 && prompt[0] == 2, "{prompt:?}");
        let r = Request { prompt, max_tokens: 160, sampling: greedy(), ..Default::default() };
        let expected = plain(&m, &r);
        for gamma in [1, 3] {
            let g = spec(&m, &ngram(), &r, gamma);
            assert_eq!(g.tokens, expected, "ngram, γ = {gamma}, {text:?}");
            assert_eq!(
                spec(&m, &adversary(gamma as u64, &expected), &r, gamma).tokens,
                expected,
                "adversary, γ = {gamma}"
            );
        }
    }
}
