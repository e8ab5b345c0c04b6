//! The host's guard around drafter calls: a panic or a contract-breaking answer poisons the
//! drafter with a one-line reason, and nothing reaches the caller unvalidated.

mod common;

use common::{fixture, workspace_plugin};
use host::plugin::load::load;
use host::plugin::{DrafterError, LoadedDrafter};
use plugin_api::conformance::{check_root, Config, SyntheticTarget};
use plugin_api::ErrorKind;

const VOCAB: u32 = 32;

fn open_misbehaving(mode: &str) -> host::plugin::drafter::DrafterGroup {
    host::runtime::init();
    let plugin = load(&fixture("misbehaving"), None).unwrap();
    let drafter = LoadedDrafter::load(&plugin, None, &format!("mode = \"{mode}\"")).unwrap();
    let target = SyntheticTarget::new(VOCAB, 8, 2, 0).unwrap();
    let mut rows = drafter.open(target.view(), 2, VOCAB).unwrap();
    rows.prefill(&[1, 2, 3, 4], None).unwrap();
    rows
}

#[test]
fn a_panic_inside_draft_is_reported_and_poisons_the_drafter() {
    let mut rows = open_misbehaving("panic-in-draft");
    let error = rows.draft(&[5, 6], 3, &[2, 2]).unwrap_err();
    match &error {
        DrafterError::Plugin { call: "draft", error, .. } => {
            assert_eq!(error.kind, ErrorKind::PANICKED);
            assert_eq!(error.message.as_str(), "panicked in draft: misbehaving drafter panics in draft as asked");
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(
        error.to_string(),
        "drafter `misbehaving` failed in draft: panicked: panicked in draft: misbehaving drafter panics in draft as asked"
    );
    assert!(rows.is_poisoned());
    let again = rows.commit(&[5, 6], &[0, 0], None).unwrap_err();
    assert_eq!(again.to_string(), "drafter `misbehaving` is disabled for this request after an earlier failure");
}

#[test]
fn too_many_tokens_are_rejected() {
    let mut rows = open_misbehaving("too-many");
    let error = rows.draft(&[5, 6], 3, &[2, 2]).unwrap_err();
    assert_eq!(error.to_string(), "drafter `misbehaving` answered draft wrongly: row 0: 4 tokens for a depth of 3");
    assert!(rows.is_poisoned());
}

#[test]
fn out_of_vocabulary_tokens_are_rejected() {
    let mut rows = open_misbehaving("out-of-vocab");
    let error = rows.draft(&[5, 6], 3, &[2, 2]).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "drafter `misbehaving` answered draft wrongly: row 0: token id {VOCAB} outside the vocabulary of {VOCAB}"
        )
    );
}

#[test]
fn a_well_behaved_answer_passes_validation() {
    let mut rows = open_misbehaving("well-behaved");
    let proposals = rows.draft(&[5, 6], 3, &[2, 2]).unwrap();
    assert_eq!(proposals.iter().map(|p| p.tokens.clone()).collect::<Vec<_>>(), [[0], [0]]);
    assert!(!rows.is_poisoned());
}

#[test]
fn a_panic_in_the_plugins_load_becomes_an_error() {
    host::runtime::init();
    let plugin = load(&fixture("misbehaving"), None).unwrap();
    let error = LoadedDrafter::load(&plugin, None, "mode = \"panic-in-load\"").err().unwrap();
    assert_eq!(
        error.to_string(),
        "drafter `misbehaving` failed in load: panicked: panicked in load: misbehaving drafter panics in load as asked"
    );
}

#[test]
fn the_conformance_kit_passes_ngram_loaded_from_its_library() {
    host::runtime::init();
    let plugin = load(&workspace_plugin("ngram"), None).unwrap();
    let report = check_root(plugin.root, &Config::default());
    report.assert_passed();
    assert!(report.drafted > 0);
}

#[test]
fn the_conformance_kit_catches_contract_breakers() {
    host::runtime::init();
    let plugin = load(&fixture("misbehaving"), None).unwrap();
    for (mode, failing_check, why) in [
        ("too-many", "draft answer (round 0)", "row 0: 2 tokens for depth 1"),
        ("out-of-vocab", "draft answer (round 0)", "row 0: token 64 outside a vocabulary of 64"),
        ("panic-in-draft", "draft (round 0)", "panicked: panicked in draft"),
        ("well-behaved", "capture and append", "unsupported: misbehaving rows keep no state"),
    ] {
        let report = check_root(plugin.root, &Config { options: format!("mode = \"{mode}\""), ..Config::default() });
        let failures = report.failures();
        assert_eq!(failures.len(), 1, "{mode}: {report}");
        assert_eq!(failures[0].0, failing_check, "{mode}: {report}");
        assert!(failures[0].1.as_ref().unwrap_err().contains(why), "{mode}: {report}");
    }
}

#[test]
fn an_extension_the_plugin_lacks_is_absent_not_an_error() {
    let plugin = load(&workspace_plugin("ngram"), None).unwrap();
    let found = plugin.extension::<plugin_api::target::TargetInfo>("speculative-grammar/1").unwrap();
    assert!(found.is_none());
}
