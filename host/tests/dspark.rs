//! The dflash plugin on the seeds' DSpark checkpoints (`dspark.json`), against an independent
//! NumPy implementation of the equations (tests/oracle/dspark_oracle.py).

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
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/dspark").join(name);
    assert!(dir.exists(), "{} is missing: run `make oracle`", dir.display());
    dir
}

fn drafter(name: &str, options: &str) -> (Rc<Gemma4>, LoadedDrafter) {
    host::runtime::init();
    let dir = fixture(name);
    let model = Rc::new(load(&dir.join("target")).unwrap());
    let plugin = load_library(&common::workspace_plugin("dflash"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, Some(&dir.join("drafter")), options).unwrap();
    probe_open(&model, &drafter).unwrap();
    (model, drafter)
}

#[test]
fn drafts_equal_the_numpy_reference_with_and_without_truncation() {
    for name in ["dspark", "legacy"] {
        let oracle = Weights::load_file(&fixture(name).join("oracle.safetensors")).unwrap();
        let ids = |key: &str| -> Vec<u32> {
            let a = oracle.get(key).unwrap().as_dtype(Dtype::Int32).unwrap();
            a.as_slice::<i32>().iter().map(|&t| t as u32).collect()
        };
        for (options, key) in
            [("sts = false", "drafts_full"), ("", "drafts_sts"), ("min_confidence = 0.5", "drafts_min05")]
        {
            let (model, d) = drafter(name, options);
            for state in [0, 5, 20] {
                let input = ids(&format!("state{state}.input_ids"));
                let expected = ids(&format!("state{state}.{key}"));
                assert_eq!(common::drafts_after_taps(&model, &d, &input, 4), expected, "{name}, {key}, state {state}");
            }
        }
    }
}

#[test]
fn a_v1_checkpoint_is_refused_by_name() {
    host::runtime::init();
    let plugin = load_library(&common::workspace_plugin("dflash"), None).unwrap();
    let error = LoadedDrafter::load(&plugin, Some(&fixture("v1")), "").err().unwrap().to_string();
    assert!(error.contains("v1 single-vector DSpark checkpoint"), "{error}");
}

#[test]
fn greedy_output_with_dspark_equals_plain_decoding_past_the_window() {
    let (model, d) = drafter("dspark", "");
    let request = Request {
        prompt: vec![2, 17, 40, 9, 33, 17, 40, 9, 61, 5],
        max_tokens: 60,
        sampling: SamplingParams::default(),
        ..Default::default()
    };
    let plain = generate(&model, &request, |_| {}).unwrap();
    for gamma in [1, 2, 4] {
        let spec = generate_speculative(&model, &d, &request, SpecConfig::new(gamma, Verify::Match), |_| {}).unwrap();
        assert_eq!(spec.tokens, plain.tokens, "γ = {gamma}");
        assert!(spec.stats.drafter_error.is_none(), "{:?}", spec.stats.drafter_error);
        assert!(spec.stats.drafted > 0);
    }
}

#[test]
fn rejection_sampling_with_markov_corrected_probabilities_keeps_the_targets_distribution() {
    let (model, d) = drafter("dspark", "sample_drafts = true\nsts = false");
    common::assert_rejection_keeps_the_first_token_distribution(
        &model,
        &d,
        SpecConfig::new(3, Verify::Rejection),
        &Default::default(),
    );
}

#[test]
fn a_missing_or_impossible_dimension_is_refused_naming_the_key() {
    host::runtime::init();
    let plugin = load_library(&common::workspace_plugin("dflash"), None).unwrap();
    let source = fixture("dspark").join("drafter");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("dspark.json")).unwrap()).unwrap();
    let cases: [(&str, &str, Option<i64>); 3] =
        [("config", "nLayers", None), ("dims", "hiddenSize", None), ("config", "nHeads", Some(0))];
    for (section, key, value) in cases {
        let work = tempfile::tempdir().unwrap();
        std::fs::copy(source.join("model.safetensors"), work.path().join("model.safetensors")).unwrap();
        let mut edited = meta.clone();
        let map = edited[section].as_object_mut().unwrap();
        match value {
            None => map.remove(key),
            Some(v) => map.insert(key.to_owned(), v.into()),
        };
        std::fs::write(work.path().join("dspark.json"), edited.to_string()).unwrap();
        let error = LoadedDrafter::load(&plugin, Some(work.path()), "").err().unwrap().to_string();
        assert!(error.contains(&format!("`{section}.{key}`")), "{section}.{key}: {error}");
    }
}
