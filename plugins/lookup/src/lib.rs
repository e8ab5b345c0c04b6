//! Lookup drafting without weights: the tokens that followed the row's longest trailing n-gram
//! where it occurred before in the row's own text (prompt lookup, `min_ngram..=max_ngram`),
//! or the most frequent continuation of its longest trailing n-gram in a token datastore, such
//! as the target's own continuations of its training text ([`datastore`]), whichever source
//! matched the longer n-gram (the text on ties). A text repeats itself less often than a corpus
//! of its kind repeats it, so the datastore drafts where prompt lookup cannot.

use std::path::Path;
use std::rc::Rc;

use plugin_api::draft_tree::Tree;
use plugin_api::sdk::lookup::{trailing_ngram, FromText, TextRow};
use plugin_api::sdk::{DraftProvider, Drafter, Options, SourceRows, Target};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

pub mod datastore;

use datastore::{Datastore, SORTED};

pub struct Lookup;

const NAMESPACE: &str = "lookup/1";

impl Drafter for Lookup {
    type Provider = LookupProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("lookup", "prompt and datastore lookup", env!("CARGO_PKG_VERSION"))
            .summary("prompt lookup or the most frequent continuation in a datastore of token ids (REST), whichever matched longer")
            .needs_artifact()
            .option("max_ngram", "3", "longest n-gram looked up in the row's own text (at most 64)")
            .option("min_ngram", "2", "shortest n-gram looked up in the row's own text")
            .option("datastore_max_ngram", "12", "longest n-gram looked up in the datastore")
            .option(
                "min_share",
                "0.2",
                "a datastore draft stops where its most frequent next token follows less than this share of the draft's occurrences",
            )
    }

    fn load(artifact: Option<&Path>, options: &Options) -> Result<LookupProvider, PluginError> {
        let dir = artifact.ok_or_else(|| PluginError::invalid_artifact("lookup needs an artifact directory"))?;
        let settings = Settings {
            min_ngram: options.value("min_ngram")?,
            max_ngram: options.value("max_ngram")?,
            datastore_max_ngram: options.value("datastore_max_ngram")?,
            min_share: options.value("min_share")?,
        };
        settings.check()?;
        let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(LookupProvider { store: Rc::new(Datastore::load(dir)?), settings, id })
    }
}

/// The manifest's options.
#[derive(Clone, Copy)]
struct Settings {
    min_ngram: usize,
    max_ngram: usize,
    datastore_max_ngram: usize,
    min_share: f64,
}

/// The longest n-gram looked up in the row's own text: each round scans the text once per
/// length, so an unbounded length costs every round the square of the text.
const LONGEST_NGRAM: usize = 64;

impl Settings {
    fn check(&self) -> Result<(), PluginError> {
        let refuse = |why: String| Err(PluginError::invalid_options(why));
        if self.max_ngram > LONGEST_NGRAM {
            return refuse(format!("max_ngram must be at most {LONGEST_NGRAM}, got {}", self.max_ngram));
        }
        if self.min_ngram == 0 || self.min_ngram > self.max_ngram {
            return refuse(format!(
                "need 1 <= min_ngram <= max_ngram, got min_ngram = {}, max_ngram = {}",
                self.min_ngram, self.max_ngram
            ));
        }
        if !(1..SORTED).contains(&self.datastore_max_ngram) {
            return refuse(format!("datastore_max_ngram must be in 1..{SORTED}, got {}", self.datastore_max_ngram));
        }
        if !(0.0..=1.0).contains(&self.min_share) {
            return refuse(format!("min_share must be in [0, 1], got {}", self.min_share));
        }
        Ok(())
    }
}

pub struct LookupProvider {
    store: Rc<Datastore>,
    settings: Settings,
    id: String,
}

impl DraftProvider for LookupProvider {
    type Rows = SourceRows<TextRow<Shared>>;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: self.id.as_str().into(),
            weights_bytes: self.store.bytes() as u64,
            namespace: NAMESPACE.into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }

    fn open(&self, target: Target, rows: usize) -> Result<SourceRows<TextRow<Shared>>, PluginError> {
        let vocab = target.info().vocab_size;
        if self.store.largest_token() >= vocab {
            return Err(PluginError::incompatible_target(format!(
                "datastore {}: token id {} is past the target's vocabulary of {vocab}: it was made with another tokenizer",
                self.id,
                self.store.largest_token()
            )));
        }
        let shared = Shared { store: self.store.clone(), settings: self.settings };
        Ok(SourceRows::new(shared, TextRow::default(), rows, NAMESPACE))
    }
}

/// What the rows of a group share.
pub struct Shared {
    store: Rc<Datastore>,
    settings: Settings,
}

impl FromText for Shared {
    fn draft(&self, text: &[u32], depth: usize) -> Vec<u32> {
        let n = &self.settings;
        let (in_text, from_text) = trailing_ngram(text, n.min_ngram, n.max_ngram, depth);
        let (in_store, from_store) = self.store.continuation(text, n.datastore_max_ngram, depth, n.min_share);
        // The source whose match is longer knows more of the context; the text on ties.
        if (in_store > in_text && !from_store.is_empty()) || from_text.is_empty() {
            from_store
        } else {
            from_text.to_vec()
        }
    }

    /// The datastore's continuations as a tree and the text's continuation as a branch of it:
    /// the source whose match is longer first, the other's nodes while the budget lasts.
    fn draft_tree(&self, text: &[u32], depth: usize, nodes: usize) -> Option<Tree> {
        let n = &self.settings;
        let (in_text, from_text) = trailing_ngram(text, n.min_ngram, n.max_ngram, depth.min(nodes));
        let (in_store, from_store) = self.store.continuations(text, n.datastore_max_ngram, depth, nodes, n.min_share);
        let from_text = Tree::chain(from_text);
        let (mut tree, other) = if in_store > in_text && !from_store.is_empty() {
            (from_store, from_text)
        } else {
            (from_text, from_store)
        };
        tree.graft(&other, nodes);
        Some(tree)
    }
}

plugin_api::export_drafter!(Lookup);

#[cfg(test)]
mod tests {
    use plugin_api::draft_tree::ROOT;

    use super::*;

    /// The draft of `depth` tokens to follow `text` (its last token the pending one) against
    /// a datastore of `store`.
    fn draft(store: Vec<u32>, text: &[u32], depth: usize) -> Vec<u32> {
        let settings = Settings { min_ngram: 2, max_ngram: 3, datastore_max_ngram: 12, min_share: 0.0 };
        Shared { store: Rc::new(Datastore::new(store)), settings }.draft(text, depth)
    }

    #[test]
    fn the_longer_match_wins_and_the_text_on_ties() {
        // The text's own "5 6" was followed by 9; the datastore knows "4 5 6", followed by 7.
        let text = [5, 6, 9, 1, 4, 5, 6];
        assert_eq!(draft(vec![4, 5, 6, 7, 8], &text, 2), [7, 8]);
        // The datastore knows only "5 6" too: a tie, and the text's continuation.
        assert_eq!(draft(vec![5, 6, 7, 8], &text, 2), [9, 1]);
        // No n-gram of the text recurs: the datastore's, however short its match.
        assert_eq!(draft(vec![3, 6, 7], &[1, 2, 6], 2), [7]);
    }

    #[test]
    fn a_tree_holds_both_sources_the_longer_match_first() {
        let shared = |store: Vec<u32>| {
            let settings = Settings { min_ngram: 2, max_ngram: 3, datastore_max_ngram: 12, min_share: 0.0 };
            Shared { store: Rc::new(Datastore::new(store)), settings }
        };
        let text = [5, 6, 9, 1, 4, 5, 6];
        // The datastore matches "4 5 6" (longer): its path 7 8 first, then the text's 9 1.
        let tree = shared(vec![4, 5, 6, 7, 8]).draft_tree(&text, 2, 4).unwrap();
        assert_eq!((tree.tokens, tree.parents), (vec![7, 8, 9, 1], vec![ROOT, 0, ROOT, 2]));
        // A tie: the text's first; the budget cuts the datastore's second node.
        let tree = shared(vec![5, 6, 7, 8]).draft_tree(&text, 2, 3).unwrap();
        assert_eq!(tree.tokens, [9, 1, 7]);
        // The tree's main path is the chain's draft.
        assert_eq!(draft(vec![5, 6, 7, 8], &text, 2), [9, 1]);
    }
}

#[cfg(test)]
mod conformance {
    use std::path::{Path, PathBuf};

    use plugin_api::conformance::{check, Config};
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    /// A datastore directory holding `bytes` as tensor `token_ids` of `dtype` and `shape`.
    fn datastore(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let view = TensorView::new(dtype, shape.to_vec(), bytes).unwrap();
        let file = safetensors::serialize([(super::datastore::TENSOR, view)], &None).unwrap();
        std::fs::write(dir.path().join(super::datastore::FILE), file).unwrap();
        dir
    }

    /// Token ids from the kit's small alphabet, so that its prompts' n-grams occur.
    fn small_alphabet() -> tempfile::TempDir {
        let ids: Vec<u16> = (0..4000u16).map(|i| (i * 7 + i / 5) % 13).collect();
        datastore(Dtype::U16, &[ids.len()], &ids.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>())
    }

    fn with(artifact: &Path) -> Config {
        Config { artifact: Some(artifact.to_owned()), ..Config::default() }
    }

    fn load_error(config: &Config) -> String {
        let report = check::<super::Lookup>(config);
        let failures = report.failures();
        let failure = failures.first().unwrap_or_else(|| panic!("passed: {report}"));
        failure.1.clone().unwrap_err()
    }

    #[test]
    fn passes_the_conformance_kit_with_the_demo_datastore() {
        let shipped = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/kjv-gemma4-lookup");
        check::<super::Lookup>(&Config::demo_target(shipped)).assert_passed();
    }

    #[test]
    fn drafts_from_the_datastore_in_batches_and_deep_drafts() {
        let dir = small_alphabet();
        // Prompt lookup off (its shortest n-gram longer than the kit's prompts), so every draft
        // comes from the datastore.
        let config = Config {
            options: "min_ngram = 30\nmax_ngram = 30\n".into(),
            rows: 5,
            depth: 7,
            rounds: 12,
            ..with(dir.path())
        };
        let report = check::<super::Lookup>(&config);
        assert!(report.passed(), "{report}");
        assert!(report.drafted > 0, "no tokens drafted in {} rounds", config.rounds);
        assert!(report.tree_nodes > 0, "no trees drafted in {} rounds", config.rounds);
    }

    #[test]
    fn refuses_a_datastore_it_cannot_read_naming_file_and_tensor() {
        let empty = tempfile::tempdir().unwrap();
        assert!(load_error(&with(empty.path())).contains("no datastore.safetensors"));
        let floats = datastore(Dtype::F32, &[2], &[0; 8]);
        assert!(load_error(&with(floats.path())).contains("tensor `token_ids` has dtype F32, expected U16 or U32"));
        let matrix = datastore(Dtype::U32, &[2, 1], &[0; 8]);
        assert!(load_error(&with(matrix.path())).contains("has shape [2, 1], expected one axis"));
        std::fs::write(matrix.path().join(super::datastore::FILE), b"not safetensors").unwrap();
        assert!(load_error(&with(matrix.path())).contains("not a valid safetensors file"));
    }

    #[test]
    fn refuses_a_target_whose_vocabulary_lacks_its_tokens() {
        let dir = datastore(Dtype::U32, &[2], &[1, 0, 0, 0, 0x10, 0x27, 0, 0]);
        let error = load_error(&Config { vocab_size: 512, ..with(dir.path()) });
        assert!(error.contains("token id 10000 is past the target's vocabulary of 512"), "{error}");
    }

    #[test]
    fn refuses_bad_options() {
        let dir = small_alphabet();
        let options = |o: &str| Config { options: o.into(), ..with(dir.path()) };
        assert!(load_error(&options("min_ngram = 4\nmax_ngram = 2\n")).contains("min_ngram = 4, max_ngram = 2"));
        assert!(load_error(&options("datastore_max_ngram = 0\n")).contains("datastore_max_ngram must be in 1..32"));
        assert!(load_error(&options("min_share = 1.5\n")).contains("min_share must be in [0, 1], got 1.5"));
        assert!(load_error(&options("max_ngram = 1000000000\n")).contains("max_ngram must be at most 64"));
    }
}
