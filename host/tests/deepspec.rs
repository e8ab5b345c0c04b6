//! The deepspec drafter against its oracle (dspark-mlx 0.1.0 on a tiny random target and
//! Gemma4DSparkModel drafter that tests/oracle/deepspec_oracle.py writes) and in the loop.

mod common;

use std::path::{Path, PathBuf};
use std::rc::Rc;

use host::generate::{generate, Request};
use host::model::{load, Gemma4};
use host::plugin::load::load as load_library;
use host::plugin::LoadedDrafter;
use host::sampling::SamplingParams;
use host::speculative::{generate_speculative, probe_open, SpecConfig, Verify};
use mlx_rs::Dtype;
use plugin_api::nn::Weights;

/// A fixture: `gemma4-dense` (K=V, as released) or `gemma4-dense-v-proj` (a separate v_proj).
fn fixture_of(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspec").join(name);
    assert!(dir.join("drafter/config.json").exists(), "{} is missing: run `make oracle`", dir.display());
    dir
}

fn setup_of(name: &str, options: &str) -> (Rc<Gemma4>, LoadedDrafter) {
    host::runtime::init();
    let dir = fixture_of(name);
    let model = Rc::new(load(&dir.join("target")).unwrap());
    let plugin = load_library(&common::workspace_plugin("deepspec"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, Some(&dir.join("drafter")), options).unwrap();
    probe_open(&model, &drafter).unwrap();
    (model, drafter)
}

fn setup(options: &str) -> (Rc<Gemma4>, LoadedDrafter) {
    setup_of("gemma4-dense", options)
}

#[test]
fn drafts_and_truncation_equal_dspark_mlx_for_several_target_states() {
    for name in ["gemma4-dense", "gemma4-dense-v-proj"] {
        drafts_equal_the_oracle(name);
    }
}

fn drafts_equal_the_oracle(name: &str) {
    let oracle = Weights::load_file(&fixture_of(name).join("oracle.safetensors")).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        let a = oracle.get(key).unwrap().as_dtype(Dtype::Int32).unwrap();
        // A threshold can cut a draft to nothing: an empty array.
        if a.size() == 0 {
            return Vec::new();
        }
        a.as_slice::<i32>().iter().map(|&t| t as u32).collect()
    };
    for (options, key) in [
        ("", "draft_tokens"),
        ("confidence_threshold = 0.3", "drafts_t03"),
        ("confidence_threshold = 0.6", "drafts_t06"),
    ] {
        let (model, drafter) = setup_of(name, options);
        for state in [0, 5, 20] {
            let input = ids(&format!("state{state}.input_ids"));
            let expected = ids(&format!("state{state}.{key}"));
            assert_eq!(
                common::drafts_after_taps(&model, &drafter, &input, 4),
                expected,
                "{name}: {key}, state {state}"
            );
        }
    }
}

#[test]
fn greedy_output_with_deepspec_equals_plain_decoding_past_the_window() {
    for options in ["", "confidence_threshold = 0.5"] {
        let (model, drafter) = setup(options);
        let request = Request {
            prompt: vec![2, 17, 40, 9, 33, 17, 40, 9, 61, 5],
            max_tokens: 60,
            sampling: SamplingParams::default(),
            ..Default::default()
        };
        let plain = generate(&model, &request, |_| {}).unwrap();
        for gamma in [1, 2, 4] {
            let spec = generate_speculative(&model, &drafter, &request, SpecConfig::new(gamma, Verify::Match), |_| {})
                .unwrap();
            assert_eq!(spec.tokens, plain.tokens, "{options:?}, γ = {gamma}");
            assert!(spec.stats.drafter_error.is_none(), "{:?}", spec.stats.drafter_error);
            // Without a threshold every round drafts; with one a round may propose nothing.
            if options.is_empty() {
                assert!(spec.stats.drafted > 0, "γ = {gamma}: nothing was drafted");
            }
        }
    }
}

#[test]
fn rejection_sampling_with_markov_corrected_probabilities_keeps_the_targets_distribution() {
    let (model, drafter) = setup("sample_drafts = true");
    common::assert_rejection_keeps_the_first_token_distribution(
        &model,
        &drafter,
        SpecConfig::new(3, Verify::Rejection),
        &Default::default(),
    );
}
