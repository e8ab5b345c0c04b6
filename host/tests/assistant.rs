//! The assistant drafter against its oracle (transformers' Gemma 4 assistant, on tiny random
//! checkpoints that tests/oracle/assistant_oracle.py writes) and inside the verify loop.

mod common;

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlx_rs::{Array, Dtype};
use plugin_api::nn::Weights;

use host::generate::{generate, Request};
use host::model::{load, Gemma4};
use host::plugin::load::load as load_library;
use host::plugin::LoadedDrafter;
use host::sampling::SamplingParams;
use host::speculative::{generate_speculative, probe_open, SpecConfig, Verify};
use host::target_view::TargetView;

fn fixture(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/assistant").join(name);
    assert!(dir.join("assistant/config.json").exists(), "{} is missing: run `make oracle`", dir.display());
    dir
}

fn setup(name: &str) -> (Rc<Gemma4>, LoadedDrafter) {
    host::runtime::init();
    let dir = fixture(name);
    let model = Rc::new(load(&dir.join("target")).unwrap());
    let plugin = load_library(&common::workspace_plugin("assistant"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, Some(&dir.join("assistant")), "").unwrap();
    probe_open(&model, &drafter).unwrap();
    (model, drafter)
}

/// The assistant's drafts for a target that has processed all of `ids` but the last, which is
/// the pending token: the state transformers' assistant drafts from.
fn drafts_after(model: &Rc<Gemma4>, drafter: &LoadedDrafter, ids: &[u32], depth: usize) -> Vec<u32> {
    let (prefix, last) = ids.split_at(ids.len() - 1);
    let caches = Rc::new(RefCell::new(model.make_caches(1, 8)));
    let tokens = Array::from_slice(&prefix.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, prefix.len() as i32]);
    let hidden = model.forward_hidden(&tokens, &mut caches.borrow_mut(), None).unwrap();
    let view = TargetView::new(model.clone(), caches.clone(), drafter.info.capabilities.ports);
    let mut rows = drafter.open(view.boxed(), 1, model.config.vocab_size as u32).unwrap();
    rows.prefill(prefix, Some(&hidden)).unwrap();
    rows.draft(last, depth, &[0]).unwrap().remove(0).tokens
}

#[test]
fn drafts_equal_transformers_for_several_target_states() {
    for name in ["centroids", "tied"] {
        let (model, drafter) = setup(name);
        let oracle = Weights::load_file(&fixture(name).join("oracle.safetensors")).unwrap();
        let ids = |key: &str| -> Vec<u32> {
            let a = oracle.get(key).unwrap().as_dtype(Dtype::Int32).unwrap();
            a.as_slice::<i32>().iter().map(|&t| t as u32).collect()
        };
        for state in [0, 5, 20] {
            let input = ids(&format!("state{state}.input_ids"));
            let expected = ids(&format!("state{state}.draft_tokens"));
            if state == 20 {
                assert!(
                    input.len() > 3 * model.config.sliding_window,
                    "{name}: the last state must be past the window"
                );
            }
            assert_eq!(drafts_after(&model, &drafter, &input, expected.len()), expected, "{name}, state {state}");
        }
    }
}

#[test]
fn greedy_output_with_the_assistant_equals_plain_decoding_past_the_window() {
    for name in ["centroids", "tied"] {
        let (model, drafter) = setup(name);
        let request = Request {
            prompt: vec![2, 17, 40, 9, 33, 17, 40, 9, 61, 5],
            max_tokens: 60,
            sampling: SamplingParams::default(),
            ..Default::default()
        };
        assert!(request.prompt.len() + request.max_tokens > 3 * model.config.sliding_window);
        let plain = generate(&model, &request, |_| {}).unwrap();
        for gamma in [1, 3, 5] {
            let spec = generate_speculative(&model, &drafter, &request, SpecConfig::new(gamma, Verify::Match), |_| {})
                .unwrap();
            assert_eq!(spec.tokens, plain.tokens, "{name}, γ = {gamma}");
            assert!(spec.stats.drafter_error.is_none(), "{name}: {:?}", spec.stats.drafter_error);
            assert!(spec.stats.drafted > 0);
        }
    }
}
