//! Prompt lookup: find the longest trailing n-gram (n from `max_ngram` down to `min_ngram`) at
//! its first earlier occurrence in the row's text, and propose the tokens that followed it.
//! No weights, no target ports: it only remembers each row's tokens.

use std::path::Path;

use plugin_api::sdk::lookup::{trailing_ngram, FromText, TextRow};
use plugin_api::sdk::{DraftProvider, Drafter, Options, SourceRows, Target};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

pub struct Ngram;

const NAMESPACE: &str = "ngram/1";
/// The longest n-gram a row may look up: each round scans the row's text once per length, so an
/// unbounded length costs every round the square of the text.
const LONGEST_NGRAM: usize = 64;

impl Drafter for Ngram {
    type Provider = NgramProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("ngram", "prompt lookup", env!("CARGO_PKG_VERSION"))
            .summary("proposes the tokens that followed the longest trailing n-gram earlier in the text")
            .option("max_ngram", "3", "longest n-gram to look up (at most 64)")
            .option("min_ngram", "1", "shortest n-gram to look up")
    }

    fn load(_artifact: Option<&Path>, options: &Options) -> Result<NgramProvider, PluginError> {
        let max_ngram: usize = options.value("max_ngram")?;
        let min_ngram: usize = options.value("min_ngram")?;
        if max_ngram > LONGEST_NGRAM {
            return Err(PluginError::invalid_options(format!(
                "max_ngram must be at most {LONGEST_NGRAM}, got {max_ngram}"
            )));
        }
        if min_ngram == 0 || min_ngram > max_ngram {
            return Err(PluginError::invalid_options(format!(
                "need 1 <= min_ngram <= max_ngram, got min_ngram = {min_ngram}, max_ngram = {max_ngram}"
            )));
        }
        Ok(NgramProvider(Lengths { min: min_ngram, max: max_ngram }))
    }
}

/// The n-gram lengths looked up, longest first.
#[derive(Clone, Copy)]
pub struct Lengths {
    min: usize,
    max: usize,
}

pub struct NgramProvider(Lengths);

impl DraftProvider for NgramProvider {
    type Rows = SourceRows<TextRow<Lengths>>;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: format!("ngram-{}-{}", self.0.min, self.0.max).into(),
            weights_bytes: 0,
            namespace: NAMESPACE.into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }

    fn open(&self, _target: Target, rows: usize) -> Result<SourceRows<TextRow<Lengths>>, PluginError> {
        Ok(SourceRows::new(self.0, TextRow::default(), rows, NAMESPACE))
    }
}

impl FromText for Lengths {
    fn draft(&self, text: &[u32], depth: usize) -> Vec<u32> {
        trailing_ngram(text, self.min, self.max, depth).1.to_vec()
    }
}

plugin_api::export_drafter!(Ngram);

#[cfg(test)]
mod conformance {
    use plugin_api::conformance::{check, Config};

    #[test]
    fn passes_the_conformance_kit() {
        check::<super::Ngram>(&Config::default()).assert_passed();
    }

    #[test]
    fn passes_with_options_batches_and_deep_drafts() {
        let config = Config {
            options: "max_ngram = 5\nmin_ngram = 2\n".into(),
            rows: 5,
            depth: 7,
            rounds: 12,
            ..Config::default()
        };
        check::<super::Ngram>(&config).assert_passed();
    }

    #[test]
    fn drafts_something_on_a_repetitive_prompt() {
        // The kit's prompts come from a small alphabet, so prompt lookup must find matches;
        // a kit that never saw a non-empty draft would check little.
        let report = check::<super::Ngram>(&Config::default());
        assert!(report.passed(), "{report}");
        assert!(report.drafted > 0, "no tokens drafted in {} rounds", Config::default().rounds);
    }

    #[test]
    fn refuses_bad_options() {
        let report =
            check::<super::Ngram>(&Config { options: "min_ngram = 4\nmax_ngram = 2\n".into(), ..Config::default() });
        let failure = &report.failures()[0];
        assert_eq!(failure.0, "load");
        assert!(failure.1.as_ref().unwrap_err().contains("min_ngram = 4, max_ngram = 2"), "{report}");
        let report = check::<super::Ngram>(&Config { options: "max_ngram = 1000000000\n".into(), ..Config::default() });
        let failure = &report.failures()[0];
        assert!(failure.1.as_ref().unwrap_err().contains("max_ngram must be at most 64, got 1000000000"), "{report}");
        let report = check::<super::Ngram>(&Config { options: "max_gram = 2\n".into(), ..Config::default() });
        assert!(report.failures()[0].1.as_ref().unwrap_err().contains("unknown option `max_gram`"), "{report}");
    }
}
