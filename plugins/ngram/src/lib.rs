//! Prompt lookup: find the longest trailing n-gram (n from `max_ngram` down to `min_ngram`) at
//! its first earlier occurrence in the row's text, and propose the tokens that followed it.
//! No weights, no target ports: it only remembers each row's tokens.

use std::path::Path;

use plugin_api::abi::{RowState, TokenRows};
use plugin_api::mlx_rs::Array;
use plugin_api::sdk::{DraftProvider, DraftRows, Drafter, Options, Proposal, Target};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

pub struct Ngram;

const NAMESPACE: &str = "ngram/1";

impl Drafter for Ngram {
    type Provider = NgramProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("ngram", "prompt lookup", env!("CARGO_PKG_VERSION"))
            .summary("proposes the tokens that followed the longest trailing n-gram earlier in the text")
            .option("max_ngram", "3", "longest n-gram to look up")
            .option("min_ngram", "1", "shortest n-gram to look up")
    }

    fn load(_artifact: Option<&Path>, options: &Options) -> Result<NgramProvider, PluginError> {
        let max_ngram: usize = options.get_or("max_ngram", 3)?;
        let min_ngram: usize = options.get_or("min_ngram", 1)?;
        if min_ngram == 0 || min_ngram > max_ngram {
            return Err(PluginError::invalid_options(format!(
                "need 1 <= min_ngram <= max_ngram, got min_ngram = {min_ngram}, max_ngram = {max_ngram}"
            )));
        }
        Ok(NgramProvider { max_ngram, min_ngram })
    }
}

pub struct NgramProvider {
    max_ngram: usize,
    min_ngram: usize,
}

impl DraftProvider for NgramProvider {
    type Rows = NgramRows;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: format!("ngram-{}-{}", self.min_ngram, self.max_ngram).into(),
            weights_bytes: 0,
            namespace: NAMESPACE.into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }

    fn open(&self, _target: Target, rows: usize) -> Result<NgramRows, PluginError> {
        Ok(NgramRows {
            max_ngram: self.max_ngram,
            min_ngram: self.min_ngram,
            history: vec![Vec::new(); rows],
        })
    }
}

pub struct NgramRows {
    max_ngram: usize,
    min_ngram: usize,
    /// Every token each row has committed, in order.
    history: Vec<Vec<u32>>,
}

/// The longest trailing n-gram of `text` (n in `min..=max`) at its first earlier occurrence,
/// and up to `depth` tokens that followed it there.
pub fn lookup(text: &[u32], min: usize, max: usize, depth: usize) -> &[u32] {
    for n in (min..=max).rev() {
        if text.len() <= n {
            continue;
        }
        let tail = &text[text.len() - n..];
        // Occurrences that end before the tail starts, so at least one token follows them.
        if let Some(start) = text[..text.len() - 1].windows(n).position(|w| w == tail) {
            let from = start + n;
            return &text[from..(from + depth).min(text.len())];
        }
    }
    &[]
}

impl NgramRows {
    fn check_rows(&self, what: &str, got: usize) -> Result<(), PluginError> {
        if got != self.history.len() {
            return Err(PluginError::invalid_argument(format!(
                "{what} has {got} rows, the group has {}",
                self.history.len()
            )));
        }
        Ok(())
    }
}

impl DraftRows for NgramRows {
    fn prefill(&mut self, tokens: TokenRows<'_>, _context: Option<Array>) -> Result<(), PluginError> {
        self.check_rows("prefill", tokens.rows as usize)?;
        for (r, history) in self.history.iter_mut().enumerate() {
            history.extend_from_slice(tokens.row(r));
        }
        Ok(())
    }

    fn draft(&mut self, pending: &[u32], depth: usize, _steps: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        self.check_rows("draft", pending.len())?;
        let (min, max) = (self.min_ngram, self.max_ngram);
        Ok(self
            .history
            .iter_mut()
            .zip(pending)
            .map(|(history, &p)| {
                history.push(p);
                let found = lookup(history, min, max, depth).to_vec();
                history.pop();
                Proposal::tokens(found)
            })
            .collect())
    }

    fn commit(&mut self, window: TokenRows<'_>, accepted: &[u32], _context: Option<Array>) -> Result<(), PluginError> {
        self.check_rows("commit", window.rows as usize)?;
        self.check_rows("commit's accepted counts", accepted.len())?;
        for (r, history) in self.history.iter_mut().enumerate() {
            let keep = accepted[r] as usize + 1;
            let row = window.row(r);
            if keep > row.len() {
                return Err(PluginError::invalid_argument(format!(
                    "row {r} accepted {} drafts of a window of {}",
                    accepted[r],
                    row.len()
                )));
            }
            history.extend_from_slice(&row[..keep]);
        }
        Ok(())
    }

    fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
        let rows = self.history.len();
        if let Some(&bad) = keep.iter().find(|&&r| r as usize >= rows) {
            return Err(PluginError::invalid_argument(format!("filter_rows keeps row {bad} of {rows}")));
        }
        self.history = keep.iter().map(|&r| self.history[r as usize].clone()).collect();
        Ok(())
    }

    fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
        for state in states {
            if state.namespace.as_str() != NAMESPACE {
                return Err(PluginError::invalid_argument(format!(
                    "row state of namespace `{}` given to ngram ({NAMESPACE})",
                    state.namespace
                )));
            }
            self.history.push(state.ids.into_vec());
        }
        Ok(())
    }

    fn capture(&mut self, row: usize) -> Result<RowState, PluginError> {
        let history = self
            .history
            .get(row)
            .ok_or_else(|| PluginError::invalid_argument(format!("capture of row {row} of {}", self.history.len())))?;
        Ok(RowState {
            namespace: NAMESPACE.into(),
            processed: history.len() as u64,
            ids: history.clone().into(),
            tensors: Default::default(),
        })
    }
}

plugin_api::export_drafter!(Ngram);

#[cfg(test)]
mod tests {
    use super::lookup;

    #[test]
    fn prefers_the_longest_trailing_ngram() {
        // "1 2 3" occurs at 0; "3" alone first occurs at 2 too, but the 3-gram wins.
        let text = [1, 2, 3, 9, 1, 2, 3];
        assert_eq!(lookup(&text, 1, 3, 2), &[9, 1]);
    }

    #[test]
    fn uses_the_first_earlier_occurrence() {
        let text = [5, 1, 5, 2, 5];
        assert_eq!(lookup(&text, 1, 1, 1), &[1]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_stops_at_the_text_end() {
        let text = [7, 8, 4, 8];
        assert_eq!(lookup(&text, 1, 3, 5), &[4, 8]);
        assert_eq!(lookup(&[1, 2, 3], 1, 3, 4), &[] as &[u32]);
    }
}

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
        let report = check::<super::Ngram>(&Config { options: "max_gram = 2\n".into(), ..Config::default() });
        assert!(report.failures()[0].1.as_ref().unwrap_err().contains("unknown option `max_gram`"), "{report}");
    }
}
