//! How often decoding waits for MLX. On MLX's route (Metal, CUDA, `HOST_KERNELS=mlx`) the host
//! waits once per plain step (for the token) and once per speculative round (for the window's
//! tokens); a drafter that computes on the device waits for its own proposal besides, and ngram,
//! which computes on the host, does not. On the CPU loops' route the host reads what MLX
//! already computed in host memory and makes no counted wait at all.

mod common;

use std::path::Path;
use std::rc::Rc;

use host::generate::{generate, Event, Request};
use host::model::load;
use host::plugin::load::load as load_library;
use host::plugin::LoadedDrafter;
use host::sampling::SamplingParams;
use host::speculative::{generate_speculative, SpecConfig, Verify};
use plugin_api::nn::sync::waits;

const PROMPT: [u32; 12] = [2, 17, 40, 9, 33, 17, 40, 9, 61, 5, 17, 40];

/// Waits per plain step and per round on this process's route.
fn per_step() -> usize {
    if kernels::route::on_cpu() {
        0
    } else {
        1
    }
}

fn settings() -> [SamplingParams; 2] {
    [SamplingParams::default(), SamplingParams { temperature: 0.8, top_p: 0.9, seed: 3, ..Default::default() }]
}

/// The waits counted when each token was emitted.
fn waits_at_tokens(counts: &mut Vec<usize>) -> impl FnMut(Event) + '_ {
    move |event| {
        if let Event::Token(_) = event {
            counts.push(waits());
        }
    }
}

#[test]
fn plain_decoding_waits_once_per_token() {
    host::runtime::init();
    let model = load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/ple-kvshare")).unwrap();
    for params in settings() {
        let request = Request { prompt: PROMPT.to_vec(), max_tokens: 24, sampling: params, eos: vec![] };
        let mut counts = Vec::new();
        generate(&model, &request, waits_at_tokens(&mut counts)).unwrap();
        assert_eq!(counts.len(), 24);
        let between: Vec<usize> = counts.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(between.iter().all(|&n| n == per_step()), "{params:?}: waits between tokens {between:?}");
    }
}

#[test]
fn a_speculative_round_waits_once() {
    host::runtime::init();
    let model = Rc::new(load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense")).unwrap());
    let plugin = load_library(&common::workspace_plugin("ngram"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, None, "max_ngram = 3").unwrap();
    for params in settings() {
        let request = Request { prompt: PROMPT.to_vec(), max_tokens: 40, sampling: params, eos: vec![] };
        let plain = generate(&model, &request, |_| ()).unwrap().tokens;
        let mut counts = Vec::new();
        let config = SpecConfig { draft_tokens: 4, verify: Verify::Match };
        let spec = generate_speculative(&model, &drafter, &request, config, waits_at_tokens(&mut counts)).unwrap();
        assert_eq!(spec.tokens, plain, "{params:?}");
        assert!(spec.stats.accepted > 0, "{params:?}: ngram never drafted right: {:?}", spec.stats);
        // A round's tokens are emitted after its one wait, so tokens of one round share a count.
        let mut rounds = counts.clone();
        rounds.dedup();
        let between: Vec<usize> = rounds.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(between.iter().all(|&n| n == per_step()), "{params:?}: waits between rounds {between:?}");
        if per_step() > 0 {
            assert_eq!(rounds.len(), spec.stats.rounds, "{params:?}: one count per round");
        }
    }
}
