//! Gemma 4's "-assistant" drafter. It keeps no KV cache: each draft step projects the target's
//! scaled embedding of the input token and the target hidden that produced it into its own
//! space, runs a few layers whose queries attend to the target's last sliding and last full
//! donor K/V (read-only views), and projects back for the next step. Its only state per row is
//! the last true target hidden, so rollback needs nothing from it.

mod config;
mod model;

use std::path::Path;
use std::rc::Rc;

use plugin_api::draft_tree::Tree;
use plugin_api::mlx_rs::Array;
use plugin_api::sdk::{
    taps, DraftProvider, DraftSource, Drafter, Options, Proposal, Snapshot, SourceRows, Target, TreeProposal,
};
use plugin_api::target::LayerKind;
use plugin_api::{Capabilities, Descriptor, PluginError, Ports, ProviderInfo};

pub use model::Assistant;

pub struct AssistantDrafter;

const NAMESPACE: &str = "gemma4-assistant/1";

fn capabilities() -> Capabilities {
    // No tap layers: the context is the target's final hidden states.
    Capabilities { ports: Ports::EMBED.union(Ports::DONORS).union(Ports::TAPS), ..Capabilities::default() }
}

impl Drafter for AssistantDrafter {
    type Provider = AssistantProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("assistant", "Gemma 4 assistant", env!("CARGO_PKG_VERSION"))
            .summary("Gemma 4's -assistant drafter: attends to the target's KV cache, keeps none of its own")
            .needs_artifact()
            .capabilities(capabilities())
    }

    fn load(artifact: Option<&Path>, _options: &Options) -> Result<AssistantProvider, PluginError> {
        let dir = artifact.ok_or_else(|| PluginError::invalid_artifact("the assistant needs an artifact directory"))?;
        let model = Assistant::load(dir)?;
        let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(AssistantProvider { model: Rc::new(model), id })
    }
}

pub struct AssistantProvider {
    model: Rc<Assistant>,
    id: String,
}

impl DraftProvider for AssistantProvider {
    type Rows = SourceRows<AssistantRow>;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: self.id.as_str().into(),
            weights_bytes: self.model.weight_bytes as u64,
            namespace: NAMESPACE.into(),
            trained_depth: 0,
            capabilities: capabilities(),
        }
    }

    fn open(&self, target: Target, rows: usize) -> Result<SourceRows<AssistantRow>, PluginError> {
        let info = target.info();
        let c = &self.model.config;
        if info.hidden_size as i32 != c.backbone_hidden_size {
            return Err(PluginError::incompatible_target(format!(
                "the assistant's backbone_hidden_size is {}, the target's hidden_size is {}",
                c.backbone_hidden_size, info.hidden_size
            )));
        }
        if info.vocab_size as i32 != c.vocab_size {
            return Err(PluginError::incompatible_target(format!(
                "the assistant's vocab_size is {}, the target's is {}",
                c.vocab_size, info.vocab_size
            )));
        }
        if info.head_dim as i32 != c.head_dim || info.global_head_dim as i32 != c.global_head_dim {
            return Err(PluginError::incompatible_target(format!(
                "the assistant's head dims are {} (sliding) and {} (full), the target's {} and {}",
                c.head_dim, c.global_head_dim, info.head_dim, info.global_head_dim
            )));
        }
        // It borrows the last donor layer of each kind it has.
        let donors = &info.layer_kinds[..(info.first_kv_shared_layer as usize).min(info.layer_kinds.len())];
        for (kind, name) in [(LayerKind::SLIDING, "sliding"), (LayerKind::FULL, "full")] {
            let needed = c.layer_types.iter().any(|t| {
                matches!(
                    (t, kind),
                    (config::LayerType::Sliding, LayerKind::SLIDING) | (config::LayerType::Full, LayerKind::FULL)
                )
            });
            if needed && !donors.contains(&kind) {
                return Err(PluginError::incompatible_target(format!(
                    "the assistant has {name}-attention layers, the target has no {name}-attention layer with its own K/V"
                )));
            }
        }
        let shared = Shared { model: self.model.clone(), target };
        Ok(SourceRows::new(shared, AssistantRow::default(), rows, NAMESPACE))
    }
}

/// What the rows of a group share.
pub struct Shared {
    model: Rc<Assistant>,
    target: Target,
}

/// A row: the target hidden [1, 1, T] that produced the row's pending token (none before the
/// first prefill), and how many tokens it has seen.
#[derive(Clone, Default)]
pub struct AssistantRow {
    hidden: Option<Array>,
    processed: u64,
}

/// Position `at` of a row's context [1, L, T], as [1, 1, T].
fn position(context: &Array, at: usize) -> Result<Array, PluginError> {
    let s = context.shape();
    let all = |axis: usize| 0..s.get(axis).map_or(0, |&d| d as usize);
    Ok(plugin_api::nn::layout::slice(context, &[all(0), at..at + 1, all(2)])?)
}

impl Shared {
    /// Drafts `depth` tokens for the group's rows `rows` (each with its hidden) in one pass.
    fn draft_rows(
        &self,
        rows: &[usize],
        hiddens: &[Array],
        pending: &[u32],
        depth: usize,
    ) -> Result<Vec<Vec<u32>>, PluginError> {
        let (drafted, _) = self.draft_chain(rows, hiddens, pending, depth)?;
        plugin_api::nn::sync::eval([&drafted])?;
        Ok(drafted.as_slice::<i32>().chunks(depth).map(|row| row.iter().map(|&t| t as u32).collect()).collect())
    }

    /// [`Self::draft_rows`]' tokens [rows, depth] (int32), not yet computed, and the first
    /// step's [`model::Step::normed`] (`None` for a depth of 0).
    fn draft_chain(
        &self,
        rows: &[usize],
        hiddens: &[Array],
        pending: &[u32],
        depth: usize,
    ) -> Result<(Array, Option<Array>), PluginError> {
        let donors = self.target.read_donors()?;
        // Every row of the batch, in order (one request alone, say): the donors as they are.
        let all_rows =
            |a: &Array| a.shape().first() == Some(&(rows.len() as i32)) && rows.iter().copied().eq(0..rows.len());
        let take = |a: &Array| -> Result<Array, PluginError> {
            if all_rows(a) {
                return Ok(a.clone());
            }
            let index: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            Ok(a.take_axis(Array::from_slice(&index, &[rows.len() as i32]), 0)?)
        };
        let select = |layer: &plugin_api::target::DonorLayer| -> Result<plugin_api::target::DonorLayer, PluginError> {
            Ok(plugin_api::target::DonorLayer {
                keys: plugin_api::OwnedArray::new(take(&layer.keys.borrow().to_array())?),
                values: plugin_api::OwnedArray::new(take(&layer.values.borrow().to_array())?),
                slot_positions: plugin_api::OwnedArray::new(take(&layer.slot_positions.borrow().to_array())?),
                window: layer.window,
            })
        };
        let (sliding, full) = (select(&donors.sliding)?, select(&donors.full)?);
        let mut hidden = plugin_api::nn::layout::concat(&hiddens.iter().collect::<Vec<_>>(), 0)?;
        let heads: Vec<i32> = pending.iter().map(|&t| t as i32).collect();
        let mut ids = Array::from_slice(&heads, &[rows.len() as i32, 1]);
        let mut steps = Vec::with_capacity(depth);
        let mut first = None;
        // Every step of a round queries at the pending token's position: one past the target's
        // last cached position.
        let positions: Vec<i32> = rows.iter().map(|&r| donors.positions[r] + 1).collect();
        for _ in 0..depth {
            let embedded = self.target.embed(&ids, true)?;
            let step = self.model.step(&embedded, &hidden, &positions, &sliding, &full)?;
            // Each step takes the last one's tokens as they are (on a GPU, not yet computed):
            // the chain is read back once, at the end.
            ids = step.tokens.as_dtype(plugin_api::mlx_rs::Dtype::Int32)?.reshape(&[rows.len() as i32, 1])?;
            steps.push(ids.clone());
            hidden = step.next_hidden;
            first.get_or_insert(step.normed);
        }
        Ok((plugin_api::nn::layout::concat(&steps.iter().collect::<Vec<_>>(), 1)?, first))
    }

    /// Trees for rows `rows`: the greedy chain, and beside its first token the next
    /// [`BRANCHES`] − 1 tokens the head ranks highest there, as leaves (a sibling's own
    /// continuation would take another pass per step). `None` where the head's ranking is not
    /// read on the host ([`Assistant::top_tokens`]).
    fn draft_trees(
        &self,
        rows: &[usize],
        hiddens: &[Array],
        pending: &[u32],
        depth: usize,
        nodes: usize,
    ) -> Result<Option<Vec<Tree>>, PluginError> {
        let chain_length = depth.min(nodes);
        let (drafted, first) = self.draft_chain(rows, hiddens, pending, chain_length)?;
        let Some(first) = first else { return Ok(None) };
        let Some(ranked) = self.model.top_tokens(&first, BRANCHES)? else { return Ok(None) };
        plugin_api::nn::sync::eval([&drafted])?;
        let chains = drafted.as_slice::<i32>().chunks(chain_length);
        let trees = chains.zip(ranked).map(|(chain, ranked)| {
            let chain: Vec<u32> = chain.iter().map(|&t| t as u32).collect();
            let mut tree = Tree::chain(&chain);
            for sibling in ranked.into_iter().filter(|&t| t != chain[0]).take(nodes - chain_length) {
                tree.push(None, sibling);
            }
            tree
        });
        Ok(Some(trees.collect()))
    }
}

/// Candidates at a tree's first depth: past the third, the head's ranking rarely holds the
/// target's token.
const BRANCHES: usize = 3;

impl DraftSource for AssistantRow {
    type Shared = Shared;

    fn prefill(&mut self, _: &Shared, tokens: &[u32], context: Option<&Array>) -> Result<(), PluginError> {
        if tokens.is_empty() {
            return Ok(());
        }
        self.hidden = Some(position(taps(context, "prefill")?, tokens.len() - 1)?);
        self.processed += tokens.len() as u64;
        Ok(())
    }

    fn draft(&mut self, s: &Shared, row: usize, pending: u32, depth: usize, _: u64) -> Result<Proposal, PluginError> {
        match &self.hidden {
            Some(hidden) if depth > 0 => {
                Ok(Proposal::tokens(s.draft_rows(&[row], std::slice::from_ref(hidden), &[pending], depth)?.remove(0)))
            }
            _ => Ok(Proposal::default()),
        }
    }

    /// The rows with a hidden (rows with an empty prefill propose nothing) in one pass.
    fn draft_rows(
        s: &Shared,
        rows: &mut [AssistantRow],
        pending: &[u32],
        depth: usize,
        _steps: &[u64],
    ) -> Result<Vec<Proposal>, PluginError> {
        let mut proposals: Vec<Proposal> = rows.iter().map(|_| Proposal::default()).collect();
        let ready: Vec<usize> = (0..rows.len()).filter(|&r| rows[r].hidden.is_some()).collect();
        if depth == 0 || ready.is_empty() {
            return Ok(proposals);
        }
        let hiddens: Vec<Array> = ready.iter().map(|&r| rows[r].hidden.clone().expect("ready")).collect();
        let heads: Vec<u32> = ready.iter().map(|&r| pending[r]).collect();
        for (&r, tokens) in ready.iter().zip(s.draft_rows(&ready, &hiddens, &heads, depth)?) {
            proposals[r] = Proposal::tokens(tokens);
        }
        Ok(proposals)
    }

    fn draft_rows_on_device(
        s: &Shared,
        rows: &mut [AssistantRow],
        pending: &[u32],
        depth: usize,
        _steps: &[u64],
    ) -> Result<Option<Array>, PluginError> {
        let hiddens: Option<Vec<Array>> = rows.iter().map(|r| r.hidden.clone()).collect();
        match hiddens {
            Some(hiddens) if depth > 0 => {
                let all: Vec<usize> = (0..rows.len()).collect();
                Ok(Some(s.draft_chain(&all, &hiddens, pending, depth)?.0))
            }
            _ => Ok(None),
        }
    }

    /// The rows with a hidden branch at their first draft ([`Shared::draft_trees`]); the others
    /// propose nothing.
    fn draft_tree_rows(
        s: &Shared,
        rows: &mut [AssistantRow],
        pending: &[u32],
        depth: usize,
        nodes: usize,
        _steps: &[u64],
    ) -> Result<Vec<Option<TreeProposal>>, PluginError> {
        let mut proposals: Vec<Option<TreeProposal>> = rows.iter().map(|_| None).collect();
        let ready: Vec<usize> = (0..rows.len()).filter(|&r| rows[r].hidden.is_some()).collect();
        if depth == 0 || nodes == 0 || ready.is_empty() {
            return Ok(proposals);
        }
        let hiddens: Vec<Array> = ready.iter().map(|&r| rows[r].hidden.clone().expect("ready")).collect();
        let heads: Vec<u32> = ready.iter().map(|&r| pending[r]).collect();
        let Some(trees) = s.draft_trees(&ready, &hiddens, &heads, depth, nodes)? else { return Ok(proposals) };
        for (&r, tree) in ready.iter().zip(trees) {
            proposals[r] = Some(TreeProposal { tree, probabilities: None });
        }
        Ok(proposals)
    }

    fn commit(&mut self, _: &Shared, kept: &[u32], context: Option<&Array>) -> Result<(), PluginError> {
        // The hidden at the last kept position produced the row's next pending token.
        self.hidden = Some(position(taps(context, "commit")?, kept.len() - 1)?);
        self.processed += kept.len() as u64;
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot { processed: self.processed, ids: Vec::new(), tensors: self.hidden.iter().cloned().collect() }
    }

    fn restore(_: &Shared, snapshot: Snapshot) -> Result<AssistantRow, PluginError> {
        Ok(AssistantRow { hidden: snapshot.tensors.into_iter().next(), processed: snapshot.processed })
    }
}

plugin_api::export_drafter!(AssistantDrafter);

#[cfg(test)]
mod conformance {
    use std::path::Path;

    use plugin_api::conformance::{check, Config};

    fn artifact(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/assistant").join(name).join("assistant")
    }

    /// The synthetic target shaped like the fixtures' target (hidden 64, vocab 512, head dims
    /// 16 and 32, window 8).
    fn config(name: &str) -> Config {
        Config {
            artifact: Some(artifact(name)),
            vocab_size: 512,
            hidden_size: 64,
            head_dim: 16,
            global_head_dim: 32,
            sliding_window: 8,
            ..Config::default()
        }
    }

    #[test]
    fn the_trained_demo_drafter_passes_the_conformance_kit() {
        let trained = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/kjv-gemma4-assistant");
        let report = check::<super::AssistantDrafter>(&Config::demo_target(trained));
        report.assert_passed();
        assert!(report.drafted > 0, "nothing drafted");
        assert!(report.tree_nodes > 0, "no trees drafted");
    }

    #[test]
    fn passes_the_conformance_kit_with_either_head() {
        for name in ["centroids", "tied"] {
            let report = check::<super::AssistantDrafter>(&config(name));
            report.assert_passed();
            assert!(report.drafted > 0, "{name}: nothing drafted");
            assert!(report.tree_nodes > 0, "{name}: no trees drafted");
        }
    }

    #[test]
    fn refuses_a_target_of_another_size() {
        let report = check::<super::AssistantDrafter>(&Config { hidden_size: 48, ..config("centroids") });
        let (name, outcome) = &report.failures()[0];
        assert_eq!(name, "open");
        let why = outcome.as_ref().unwrap_err();
        assert!(why.contains("backbone_hidden_size is 64, the target's hidden_size is 48"), "{why}");
    }

    /// A copy of the centroid fixture's config with these tensors as its weights.
    fn centroid_fixture_with(tensors: Vec<(String, safetensors::tensor::TensorView<'_>)>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(artifact("centroids").join("config.json"), dir.path().join("config.json")).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), safetensors::serialize(tensors, &None).unwrap()).unwrap();
        dir
    }

    #[test]
    fn declared_centroids_without_their_tensors_fall_back_to_the_tied_head() {
        // The centroid fixture's config (use_ordered_embeddings on, num_centroids 16) with the
        // centroid tensors left out of its weights.
        let src = artifact("centroids");
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<_> =
            tensors.tensors().into_iter().filter(|(name, _)| !name.starts_with("masked_embedding.")).collect();
        let dir = centroid_fixture_with(kept);

        let declared = crate::Assistant::load(&src).unwrap();
        assert!(declared.config.use_ordered_embeddings && declared.masked_embedding.is_some());
        let stripped = crate::Assistant::load(dir.path()).unwrap();
        assert!(stripped.config.num_centroids > 0 && stripped.masked_embedding.is_none());
        let report =
            check::<super::AssistantDrafter>(&Config { artifact: Some(dir.path().to_owned()), ..config("centroids") });
        report.assert_passed();
    }

    #[test]
    fn refuses_a_token_ordering_outside_the_vocabulary() {
        // The centroid fixture with one id of its token ordering past the vocabulary's end.
        let bytes = std::fs::read(artifact("centroids").join("model.safetensors")).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let name = "masked_embedding.token_ordering";
        let ordering = tensors.tensor(name).unwrap();
        let mut ids = ordering.data().to_vec();
        let width = ids.len() / ordering.shape()[0];
        ids[..width].copy_from_slice(&99_999i64.to_le_bytes()[..width]);
        let bad = safetensors::tensor::TensorView::new(ordering.dtype(), ordering.shape().to_vec(), &ids).unwrap();
        let mut kept: Vec<_> = tensors.tensors().into_iter().filter(|(n, _)| n != name).collect();
        kept.push((name.to_owned(), bad));
        let dir = centroid_fixture_with(kept);

        let why = crate::Assistant::load(dir.path()).err().expect("refused").to_string();
        assert!(
            why.contains("masked_embedding.token_ordering holds token id 99999, outside the vocabulary of 512"),
            "{why}"
        );
    }

    #[test]
    fn refuses_a_target_with_other_head_dims() {
        let report = check::<super::AssistantDrafter>(&Config { global_head_dim: 64, ..config("centroids") });
        let why = report.failures()[0].1.as_ref().unwrap_err().clone();
        assert!(why.contains("head dims are 16 (sliding) and 32 (full), the target's 16 and 64"), "{why}");
    }

    #[test]
    fn refuses_a_missing_or_foreign_artifact() {
        let report = check::<super::AssistantDrafter>(&Config { artifact: None, ..config("centroids") });
        assert!(report.failures()[0].1.as_ref().unwrap_err().contains("needs an artifact directory"));
        let target_dir = artifact("centroids").parent().unwrap().join("target");
        let report = check::<super::AssistantDrafter>(&Config { artifact: Some(target_dir), ..config("centroids") });
        let why = report.failures()[0].1.as_ref().unwrap_err().clone();
        assert!(why.contains("`model_type` = \"gemma4_text\" is not a Gemma 4 assistant"), "{why}");
    }
}
