//! The dflash drafter against its oracle (dflash 0.1.0's MLX model on a tiny random target and
//! drafter that tests/oracle/dflash_oracle.py writes) and inside the verify loop.

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

fn fixture(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/dflash").join(name);
    assert!(dir.join("drafter/config.json").exists(), "{} is missing: run `make oracle`", dir.display());
    dir
}

fn setup(name: &str) -> (Rc<Gemma4>, LoadedDrafter) {
    host::runtime::init();
    let dir = fixture(name);
    let model = Rc::new(load(&dir.join("target")).unwrap());
    let plugin = load_library(&common::workspace_plugin("dflash"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, Some(&dir.join("drafter")), "").unwrap();
    probe_open(&model, &drafter).unwrap();
    (model, drafter)
}

#[test]
fn drafts_equal_dflash_for_several_target_states() {
    let (model, drafter) = setup("gemma4-dense");
    let oracle = Weights::load_file(&fixture("gemma4-dense").join("oracle.safetensors")).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        let a = oracle.get(key).unwrap().as_dtype(Dtype::Int32).unwrap();
        a.as_slice::<i32>().iter().map(|&t| t as u32).collect()
    };
    assert_eq!(drafter.info.capabilities.tap_layers.as_slice(), &[1, 3, 5]);
    for state in [0, 5, 20] {
        let input = ids(&format!("state{state}.input_ids"));
        let expected = ids(&format!("state{state}.draft_tokens"));
        if state == 20 {
            assert!(input.len() > 3 * model.config.sliding_window, "the last state must be past the window");
        }
        assert_eq!(common::drafts_after_taps(&model, &drafter, &input, expected.len()), expected, "state {state}");
    }
}

#[test]
fn greedy_output_with_dflash_equals_plain_decoding_past_the_window() {
    let (model, drafter) = setup("gemma4-dense");
    let request = Request {
        prompt: vec![2, 17, 40, 9, 33, 17, 40, 9, 61, 5],
        max_tokens: 60,
        sampling: SamplingParams::default(),
        ..Default::default()
    };
    let plain = generate(&model, &request, |_| {}).unwrap();
    for gamma in [1, 3, 5] {
        let spec =
            generate_speculative(&model, &drafter, &request, SpecConfig::new(gamma, Verify::Match), |_| {}).unwrap();
        assert_eq!(spec.tokens, plain.tokens, "γ = {gamma}");
        assert!(spec.stats.drafter_error.is_none(), "{:?}", spec.stats.drafter_error);
        assert!(spec.stats.drafted > 0);
    }
}

#[test]
fn rejection_sampling_with_sampled_drafts_keeps_the_targets_distribution() {
    host::runtime::init();
    let dir = fixture("gemma4-dense");
    let model = Rc::new(load(&dir.join("target")).unwrap());
    let plugin = load_library(&common::workspace_plugin("dflash"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, Some(&dir.join("drafter")), "sample_drafts = true").unwrap();
    common::assert_rejection_keeps_the_first_token_distribution(
        &model,
        &drafter,
        SpecConfig::new(2, Verify::Rejection),
        &Default::default(),
    );
    // With penalties and a bias the kept distribution is the penalized one.
    let penalties = host::sampling::Penalties {
        repetition_penalty: 1.5,
        logit_bias: vec![(17, 1.5), (40, -1.0)],
        ..Default::default()
    };
    common::assert_rejection_keeps_the_first_token_distribution(
        &model,
        &drafter,
        SpecConfig::new(2, Verify::Rejection),
        &penalties,
    );
}
