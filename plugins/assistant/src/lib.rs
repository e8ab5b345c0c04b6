//! Gemma 4's "-assistant" drafter. It keeps no KV cache: each draft step projects the target's
//! scaled embedding of the input token and the target hidden that produced it into its own
//! space, runs a few layers whose queries attend to the target's last sliding and last full
//! donor K/V (read-only views), and projects back for the next step. Its only state per row is
//! the last true target hidden, so rollback needs nothing from it.

mod config;
mod model;

use std::path::Path;
use std::rc::Rc;

use plugin_api::abi::{RowState, TokenRows};
use plugin_api::mlx_rs::Array;
use plugin_api::sdk::{DraftProvider, DraftRows, Drafter, Options, Proposal, Target};
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
    type Rows = AssistantRows;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: self.id.as_str().into(),
            weights_bytes: self.model.weight_bytes as u64,
            namespace: NAMESPACE.into(),
            trained_depth: 0,
            capabilities: capabilities(),
        }
    }

    fn open(&self, target: Target, rows: usize) -> Result<AssistantRows, PluginError> {
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
        Ok(AssistantRows { model: self.model.clone(), target, hidden: vec![None; rows], processed: vec![0; rows] })
    }
}

pub struct AssistantRows {
    model: Rc<Assistant>,
    target: Target,
    /// Per row, the target hidden [1, 1, T] that produced the row's pending token.
    hidden: Vec<Option<Array>>,
    processed: Vec<u64>,
}

/// Row `r` of x [B, L, T] at position `at`, as [1, 1, T].
fn row_at(x: &Array, r: usize, at: usize) -> Result<Array, PluginError> {
    let row = x.take_axis(Array::from_slice(&[r as i32], &[1]), 0)?;
    Ok(row.take_axis(Array::from_slice(&[at as i32], &[1]), 1)?)
}

impl AssistantRows {
    fn check_rows(&self, what: &str, got: usize) -> Result<(), PluginError> {
        if got != self.hidden.len() {
            return Err(PluginError::invalid_argument(format!(
                "{what} has {got} rows, the group has {}",
                self.hidden.len()
            )));
        }
        Ok(())
    }

    /// Drafts `depth` tokens for the rows in `rows`, all of which have a hidden.
    fn draft_rows(&self, rows: &[usize], pending: &[u32], depth: usize) -> Result<Vec<Vec<u32>>, PluginError> {
        let donors = self.target.read_donors()?;
        let take = |a: &Array| -> Result<Array, PluginError> {
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
        let hidden_rows: Vec<Array> = rows.iter().map(|&r| self.hidden[r].clone().expect("checked")).collect();
        let mut hidden = plugin_api::mlx_rs::ops::concatenate(&hidden_rows, 0)?;
        let mut ids: Vec<i32> = rows.iter().map(|&r| pending[r] as i32).collect();
        let mut drafted = vec![Vec::with_capacity(depth); rows.len()];
        // Every step of a round queries at the pending token's position: one past the target's
        // last cached position.
        let positions: Vec<i32> = rows.iter().map(|&r| donors.positions[r] + 1).collect();
        for _ in 0..depth {
            let embedded = self.target.embed(&Array::from_slice(&ids, &[rows.len() as i32, 1]), true)?;
            let step = self.model.step(&embedded, &hidden, &positions, &sliding, &full)?;
            let tokens = step.tokens.as_dtype(plugin_api::mlx_rs::Dtype::Int32)?;
            ids = tokens.as_slice::<i32>().to_vec();
            for (out, &t) in drafted.iter_mut().zip(&ids) {
                out.push(t as u32);
            }
            hidden = step.next_hidden;
        }
        Ok(drafted)
    }
}

impl DraftRows for AssistantRows {
    fn prefill(&mut self, tokens: TokenRows<'_>, context: Option<Array>) -> Result<(), PluginError> {
        self.check_rows("prefill", tokens.rows as usize)?;
        let context =
            context.ok_or_else(|| PluginError::invalid_argument("prefill without the target's hidden states"))?;
        let last = tokens.len as usize - 1;
        for r in 0..self.hidden.len() {
            self.hidden[r] = Some(row_at(&context, r, last)?);
            self.processed[r] += tokens.len as u64;
        }
        Ok(())
    }

    fn draft(&mut self, pending: &[u32], depth: usize, _steps: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        self.check_rows("draft", pending.len())?;
        // Rows with no target hidden yet (an empty prefill) propose nothing this round.
        let ready: Vec<usize> = (0..pending.len()).filter(|&r| self.hidden[r].is_some()).collect();
        let mut proposals: Vec<Proposal> = pending.iter().map(|_| Proposal::default()).collect();
        if depth == 0 || ready.is_empty() {
            return Ok(proposals);
        }
        for (r, tokens) in ready.iter().zip(self.draft_rows(&ready, pending, depth)?) {
            proposals[*r] = Proposal::tokens(tokens);
        }
        Ok(proposals)
    }

    fn commit(&mut self, window: TokenRows<'_>, accepted: &[u32], context: Option<Array>) -> Result<(), PluginError> {
        self.check_rows("commit", window.rows as usize)?;
        let context =
            context.ok_or_else(|| PluginError::invalid_argument("commit without the target's hidden states"))?;
        for (r, &a) in accepted.iter().enumerate() {
            // The hidden at the last kept position produced the row's next pending token.
            self.hidden[r] = Some(row_at(&context, r, a as usize)?);
            self.processed[r] += a as u64 + 1;
        }
        Ok(())
    }

    fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
        if let Some(&bad) = keep.iter().find(|&&r| r as usize >= self.hidden.len()) {
            return Err(PluginError::invalid_argument(format!("filter_rows keeps row {bad} of {}", self.hidden.len())));
        }
        self.hidden = keep.iter().map(|&r| self.hidden[r as usize].clone()).collect();
        self.processed = keep.iter().map(|&r| self.processed[r as usize]).collect();
        Ok(())
    }

    fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
        for state in states {
            if state.namespace.as_str() != NAMESPACE {
                return Err(PluginError::invalid_argument(format!(
                    "row state of namespace `{}` given to the assistant ({NAMESPACE})",
                    state.namespace
                )));
            }
            self.hidden.push(state.tensors.into_iter().next().map(plugin_api::OwnedArray::into_array));
            self.processed.push(state.processed);
        }
        Ok(())
    }

    fn capture(&mut self, row: usize) -> Result<RowState, PluginError> {
        let hidden = self
            .hidden
            .get(row)
            .ok_or_else(|| PluginError::invalid_argument(format!("capture of row {row} of {}", self.hidden.len())))?;
        Ok(RowState {
            namespace: NAMESPACE.into(),
            processed: self.processed[row],
            ids: Default::default(),
            tensors: hidden.iter().cloned().map(plugin_api::OwnedArray::new).collect(),
        })
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
    fn passes_the_conformance_kit_with_either_head() {
        for name in ["centroids", "tied"] {
            let report = check::<super::AssistantDrafter>(&config(name));
            report.assert_passed();
            assert!(report.drafted > 0, "{name}: nothing drafted");
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

    #[test]
    fn declared_centroids_without_their_tensors_fall_back_to_the_tied_head() {
        // The centroid fixture's config (use_ordered_embeddings on, num_centroids 16) with the
        // centroid tensors left out of its weights.
        let src = artifact("centroids");
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<_> =
            tensors.tensors().into_iter().filter(|(name, _)| !name.starts_with("masked_embedding.")).collect();
        std::fs::write(dir.path().join("model.safetensors"), safetensors::serialize(kept, &None).unwrap()).unwrap();

        let declared = crate::Assistant::load(&src).unwrap();
        assert!(declared.config.use_ordered_embeddings && declared.masked_embedding.is_some());
        let stripped = crate::Assistant::load(dir.path()).unwrap();
        assert!(stripped.config.num_centroids > 0 && stripped.masked_embedding.is_none());
        let report =
            check::<super::AssistantDrafter>(&Config { artifact: Some(dir.path().to_owned()), ..config("centroids") });
        report.assert_passed();
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
