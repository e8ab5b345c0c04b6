//! Paths of the libraries the tests load.
#![allow(dead_code)]

use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
use std::path::{Path, PathBuf};

/// A fixture library built by `make fixtures` into target/fixtures.
pub fn fixture(name: &str) -> PathBuf {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/fixtures/debug/{DLL_PREFIX}{name}{DLL_SUFFIX}"));
    assert!(path.exists(), "{} is missing: build the fixtures first (make fixtures)", path.display());
    path.canonicalize().unwrap()
}

/// A plugin of this workspace, built next to the host binary.
pub fn workspace_plugin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_host")).with_file_name(format!("{DLL_PREFIX}{name}{DLL_SUFFIX}"));
    assert!(path.exists(), "{} is missing: build the workspace first (cargo build --workspace)", path.display());
    path
}

/// A fresh plugins directory holding copies of `libraries`.
pub fn plugins_dir_with(libraries: &[&Path]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for lib in libraries {
        std::fs::copy(lib, dir.path().join(lib.file_name().unwrap())).unwrap();
    }
    dir
}

/// SplitMix64's finalizer: the test drafters' deterministic stream.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The prompt whose first generated token the rejection tests draw.
pub const REJECTION_PROMPT: [u32; 10] = [2, 17, 40, 9, 33, 17, 40, 9, 61, 5];

/// Temperature 1 over the top 4 tokens, with `seed`.
fn top_4(seed: u64) -> host::sampling::SamplingParams {
    host::sampling::SamplingParams { temperature: 1.0, top_k: 4, top_p: 1.0, min_p: 0.0, seed }
}

/// The target's distribution of the first token after [`REJECTION_PROMPT`] at temperature 1
/// over its top 4 tokens, after `penalties`: (token, weight), the weights unnormalized.
pub fn first_token_distribution(
    model: &host::model::Gemma4,
    penalties: &host::sampling::Penalties,
) -> Vec<(usize, f64)> {
    use mlx_rs::{Array, Dtype};

    let prompt = REJECTION_PROMPT;
    let mut caches = model.make_caches(1, 2);
    let ids = Array::from_slice(&prompt.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, prompt.len() as i32]);
    let hidden = model.forward_hidden(&ids, &mut caches, None).unwrap();
    let logits = host::generate::last_logits(model, &hidden).unwrap();
    let mut logits = logits.as_dtype(Dtype::Float32).unwrap().as_slice::<f32>().to_vec();
    penalties.apply(&mut logits, &prompt, &[]);
    let lp = host::sampling::filtered_logprobs(&logits, &top_4(0));
    lp.iter().enumerate().filter(|(_, x)| x.is_finite()).map(|(i, &x)| (i, (x as f64).exp())).collect()
}

/// Rejection-mode speculation with `drafter` under `config` emits, as the first token of 900
/// rows (one seed each), [`first_token_distribution`]: no token outside it, and a chi-square
/// with 3 degrees of freedom under 16.27 (significance 0.001). Returns the drafts proposed and
/// accepted over the 900 runs.
pub fn assert_rejection_keeps_the_first_token_distribution(
    model: &std::rc::Rc<host::model::Gemma4>,
    drafter: &host::plugin::LoadedDrafter,
    config: host::speculative::SpecConfig,
    penalties: &host::sampling::Penalties,
) -> (usize, usize) {
    use host::generate::Request;
    use host::speculative::generate_speculative_rows;

    assert!(drafter.info.capabilities.draft_probabilities);
    let p = first_token_distribution(model, penalties);
    let total: f64 = p.iter().map(|(_, x)| x).sum();

    let (batches, rows) = (6u64, 150u64);
    let mut counts = std::collections::BTreeMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for batch in 0..batches {
        let requests: Vec<Request> = (0..rows)
            .map(|r| Request {
                prompt: REJECTION_PROMPT.to_vec(),
                max_tokens: 3,
                sampling: top_4(batch * rows + r),
                penalties: penalties.clone(),
                ..Default::default()
            })
            .collect();
        for g in generate_speculative_rows(model, drafter, &requests, config, |_, _| {}).unwrap() {
            assert!(g.stats.drafter_error.is_none(), "{:?}", g.stats.drafter_error);
            *counts.entry(g.tokens[0] as usize).or_insert(0u64) += 1;
            drafted += g.stats.drafted;
            accepted += g.stats.accepted;
        }
    }
    assert!(drafted > 0);
    let runs = batches * rows;
    let strays: u64 = counts.iter().filter(|(t, _)| !p.iter().any(|(i, _)| i == *t)).map(|(_, c)| c).sum();
    assert_eq!(strays, 0, "tokens outside the target's support: {counts:?}");
    let chi2: f64 = p
        .iter()
        .map(|(t, w)| {
            let expected = runs as f64 * w / total;
            (*counts.get(t).unwrap_or(&0) as f64 - expected).powi(2) / expected
        })
        .sum();
    assert!(chi2 < 16.27, "chi2 = {chi2:.2}: counts {counts:?}, p {p:?}");
    (drafted, accepted)
}

/// The drafts of `drafter` for a target that has processed all of `ids` but the last (the
/// pending token), with the drafter's tapped hidden states as its context (the final hidden
/// states for a drafter that taps no layer).
pub fn drafts_after_taps(
    model: &std::rc::Rc<host::model::Gemma4>,
    drafter: &host::plugin::LoadedDrafter,
    ids: &[u32],
    depth: usize,
) -> Vec<u32> {
    let (prefix, last) = ids.split_at(ids.len() - 1);
    group_after_taps(model, drafter, prefix).draft(last, depth, &[0]).unwrap().remove(0).tokens
}

/// A one-row group of `drafter` prefilled on `prefix` as the target processed it, with the
/// drafter's tapped hidden states as its context.
pub fn group_after_taps(
    model: &std::rc::Rc<host::model::Gemma4>,
    drafter: &host::plugin::LoadedDrafter,
    prefix: &[u32],
) -> host::plugin::drafter::DrafterGroup {
    use mlx_rs::Array;
    let caches = std::rc::Rc::new(std::cell::RefCell::new(model.make_caches(1, 8)));
    let tokens = Array::from_slice(&prefix.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, prefix.len() as i32]);
    let layers: Vec<usize> = drafter.info.capabilities.tap_layers.iter().map(|&l| l as usize).collect();
    let mut taps = host::model::Taps { layers: layers.clone(), captured: Vec::new() };
    let last_hidden = model.forward_hidden(&tokens, &mut caches.borrow_mut(), Some(&mut taps)).unwrap();
    // Captured in layer order; the drafter wants them in its tap order.
    let mut sorted = layers.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let ordered: Vec<Array> = layers.iter().map(|l| taps.captured[sorted.binary_search(l).unwrap()].clone()).collect();
    let context = if ordered.is_empty() { last_hidden } else { mlx_rs::ops::concatenate(&ordered, -1).unwrap() };
    let view = host::target_view::TargetView::new(model.clone(), caches.clone(), drafter.info.capabilities.ports);
    let mut rows = drafter.open(view.boxed(), 1, model.config.vocab_size as u32).unwrap();
    rows.prefill(prefix, Some(&context)).unwrap();
    rows
}

/// Continuous batching: `requests` join a running batch between rounds (request i at round 4i)
/// and leave when they finish, request 3 cancelled after its 5th token; each row's output
/// equals its plain decoding, with `drafter` under `config` and with no drafter.
pub fn join_and_leave_mid_flight(
    m: &std::rc::Rc<host::model::Gemma4>,
    requests: &[host::generate::Request],
    drafter: &host::plugin::LoadedDrafter,
    config: host::speculative::SpecConfig,
) {
    use host::generate::{Event, Flow, Generation};
    use host::speculative::LiveBatch;
    for with_drafter in [true, false] {
        let mut batch = LiveBatch::new(m, with_drafter.then_some(drafter), config).unwrap();
        let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
        let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        const CANCELLED: usize = 3;
        let mut round = 0;
        while done.iter().any(Option::is_none) {
            // Request i joins at round 4i; request 3 is cancelled after its 5th token.
            for (i, request) in requests.iter().enumerate() {
                if round == 4 * i {
                    batch.join(i, request.clone(), |_| Flow::Continue).unwrap();
                }
            }
            for (i, g) in batch
                .round(|i, event| {
                    let Event::Token(t) = event else { return Flow::Continue };
                    streamed[i].push(t);
                    if i == CANCELLED && streamed[i].len() == 5 {
                        Flow::Stop
                    } else {
                        Flow::Continue
                    }
                })
                .unwrap()
            {
                assert!(done[i].replace(g).is_none(), "row {i} finished twice");
            }
            round += 1;
            assert!(round < 500, "the batch does not finish");
        }
        for (i, (request, g)) in requests.iter().zip(&done).enumerate() {
            let g = g.as_ref().unwrap();
            let alone = host::generate::generate(m, request, |_| {}).unwrap().tokens;
            assert_eq!(g.tokens, streamed[i], "row {i}: the stream is the output");
            if i == CANCELLED {
                assert_eq!(g.stop, host::generate::StopReason::Interrupted);
                assert_eq!(g.tokens, alone[..5], "row {i} (cancelled), drafter {with_drafter}");
            } else {
                assert_eq!(g.tokens, alone, "row {i}, drafter {with_drafter}");
            }
            assert!(g.stats.drafter_error.is_none());
        }
        let drafted: usize = done.iter().map(|g| g.as_ref().unwrap().stats.drafted).sum();
        assert_eq!(drafted > 0, with_drafter, "{drafted} drafted");
        assert!(batch.is_empty());
    }
}
