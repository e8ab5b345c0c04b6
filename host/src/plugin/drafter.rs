//! The host's side of a loaded drafter: every call checked, every answer validated, and a
//! drafter that fails once is poisoned so the request can finish without it.

use std::path::Path;

use abi_stable::std_types::{ROption, RVec};
use mlx_rs::{Array, Dtype};
use plugin_api::abi::{DrafterRootRef, ProviderBox, RowGroupBox, RowState, TokenRows};
use plugin_api::device_draft::{DeviceDraft, DEVICE_DRAFT_ID};
use plugin_api::draft_tree::{DraftTree, DRAFT_TREE_ID};
use plugin_api::sdk::{Proposal, TreeProposal};
use plugin_api::target::TargetViewBox;
use plugin_api::{ArrayRef, PluginError, ProviderInfo};

use super::load::Plugin;

#[derive(Debug, Clone, thiserror::Error)]
pub enum DrafterError {
    #[error("drafter `{kind}` failed in {call}: {error}")]
    Plugin { kind: String, call: &'static str, error: PluginError },
    #[error("drafter `{kind}` answered {call} wrongly: {reason}")]
    InvalidAnswer { kind: String, call: &'static str, reason: String },
    #[error("drafter `{kind}` is disabled for this request after an earlier failure")]
    Poisoned { kind: String },
    #[error("drafter `{kind}` cannot serve this target: {reason}")]
    Unpaired { kind: String, reason: String },
}

/// Whether `artifact` is what the plugin `descriptor` describes asks for: a directory when it
/// needs one, none when it takes none.
pub fn check_artifact(descriptor: &plugin_api::Descriptor, artifact: Option<&Path>) -> Result<(), String> {
    match (descriptor.needs_artifact, artifact) {
        (true, None) => Err(format!("drafter `{}` needs an artifact directory", descriptor.kind)),
        (false, Some(dir)) => Err(format!("drafter `{}` takes no artifact, got {}", descriptor.kind, dir.display())),
        _ => Ok(()),
    }
}

/// A loaded artifact of a plugin.
pub struct LoadedDrafter {
    kind: String,
    provider: ProviderBox,
    pub info: ProviderInfo,
    /// Its groups' drafts left on the device, where the plugin offers them (API 1.1).
    device_draft: Option<&'static DeviceDraft>,
    /// Its groups' trees of drafts, where the plugin offers them (API 1.2).
    draft_tree: Option<&'static DraftTree>,
}

impl LoadedDrafter {
    /// Loads `artifact` (if any) with the manifest's options for this drafter, as TOML text.
    pub fn load(plugin: &Plugin, artifact: Option<&Path>, options: &str) -> Result<LoadedDrafter, DrafterError> {
        LoadedDrafter::load_root(plugin.root, plugin.descriptor.kind.as_str(), artifact, options)
    }

    /// As [`LoadedDrafter::load`], from a root module already at hand (e.g. one linked in-process).
    pub fn load_root(
        root: DrafterRootRef,
        kind: &str,
        artifact: Option<&Path>,
        options: &str,
    ) -> Result<LoadedDrafter, DrafterError> {
        let kind = kind.to_owned();
        let artifact = artifact.map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        let provider = (root.load())(artifact.as_str().into(), options.into())
            .into_result()
            .map_err(|error| DrafterError::Plugin { kind: kind.clone(), call: "load", error })?;
        let info = provider.info();
        let device_draft = super::load::extension::<DeviceDraft>(root, DEVICE_DRAFT_ID)
            .map_err(|reason| DrafterError::InvalidAnswer { kind: kind.clone(), call: "load", reason })?;
        let draft_tree = super::load::extension::<DraftTree>(root, DRAFT_TREE_ID)
            .map_err(|reason| DrafterError::InvalidAnswer { kind: kind.clone(), call: "load", reason })?;
        Ok(LoadedDrafter { kind, provider, info, device_draft, draft_tree })
    }

    /// The plugin kind this drafter comes from.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Opens `rows` rows against a target of `vocab_size` tokens; an incompatible pairing is
    /// refused here.
    pub fn open(&self, target: TargetViewBox, rows: usize, vocab_size: u32) -> Result<DrafterGroup, DrafterError> {
        let group = self.provider.open(target, rows as u32).into_result().map_err(|error| DrafterError::Plugin {
            kind: self.kind.clone(),
            call: "open",
            error,
        })?;
        let (device_draft, draft_tree) = (self.device_draft, self.draft_tree);
        Ok(DrafterGroup { kind: self.kind.clone(), group, rows, vocab_size, poisoned: false, device_draft, draft_tree })
    }
}

/// A drafter's row group, as the verify loop drives it.
pub struct DrafterGroup {
    kind: String,
    group: RowGroupBox,
    rows: usize,
    vocab_size: u32,
    poisoned: bool,
    device_draft: Option<&'static DeviceDraft>,
    draft_tree: Option<&'static DraftTree>,
}

impl DrafterGroup {
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    pub fn prefill(&mut self, tokens: &[u32], context: Option<&Array>) -> Result<(), DrafterError> {
        self.live()?;
        let answer =
            self.group.prefill(TokenRows::new(tokens, self.rows), context.map(ArrayRef::new).into()).into_result();
        self.checked("prefill", answer)
    }

    /// Asks for up to `depth` tokens after each row's pending token and validates the answer:
    /// one proposal per row, no more than `depth` tokens, every id inside the vocabulary, and
    /// probabilities (if any) shaped [tokens, vocab].
    pub fn draft(&mut self, pending: &[u32], depth: usize, steps: &[u64]) -> Result<Vec<Proposal>, DrafterError> {
        self.live()?;
        let answer = self.group.draft(pending.into(), depth as u32, steps.into()).into_result();
        let rows = self.checked("draft", answer)?;
        self.validate_draft(rows, depth).map_err(|reason| {
            self.poisoned = true;
            DrafterError::InvalidAnswer { kind: self.kind.clone(), call: "draft", reason }
        })
    }

    /// [`Self::draft`]'s tokens, `depth` per row, as uint32 [rows, depth] left on the device
    /// (the extension `device-draft/1`); `None` where the drafter drafts on the host this round
    /// or has no such drafts. Their ids are checked once read ([`Self::check_device_drafts`]).
    pub fn draft_on_device(
        &mut self,
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Option<Array>, DrafterError> {
        let Some(table) = self.device_draft else { return Ok(None) };
        self.live()?;
        let answer = (table.draft)(&mut self.group, pending.into(), depth as u32, steps.into()).into_result();
        let Some(tokens) = self.checked("draft_on_device", answer)?.into_option() else { return Ok(None) };
        let tokens = tokens.into_array();
        let want = [self.rows as i32, depth as i32];
        let reason = match tokens.dtype() {
            _ if tokens.shape() != want => format!("tokens of shape {:?}, expected {want:?}", tokens.shape()),
            Dtype::Int32 | Dtype::Uint32 => return Ok(tokens.as_dtype(Dtype::Uint32).ok()),
            other => format!("tokens of type {other:?}, expected int32 or uint32"),
        };
        self.poisoned = true;
        Err(DrafterError::InvalidAnswer { kind: self.kind.clone(), call: "draft_on_device", reason })
    }

    /// A tree per row after its pending token, at most `nodes` nodes and `depth` deep (the
    /// extension `draft-tree/1`), validated: one per row, each keeping the tree's rules
    /// (`Tree::check`), probabilities (if any) [nodes, vocab]. `None` where the drafter offers
    /// no trees or drafts chains this round.
    pub fn draft_tree(
        &mut self,
        pending: &[u32],
        depth: usize,
        nodes: usize,
        steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, DrafterError> {
        let Some(table) = self.draft_tree else { return Ok(None) };
        self.live()?;
        let answer =
            (table.draft)(&mut self.group, pending.into(), depth as u32, nodes as u32, steps.into()).into_result();
        let Some(rows) = self.checked("draft_tree", answer)?.into_option() else { return Ok(None) };
        let trees = rows.into_iter().map(|row| {
            let (tree, p) = row.into();
            TreeProposal { tree, probabilities: p.map(plugin_api::OwnedArray::into_array) }
        });
        let trees: Vec<TreeProposal> = trees.collect();
        let checked = if trees.len() != self.rows {
            Err(format!("{} trees for {} rows", trees.len(), self.rows))
        } else {
            trees.iter().enumerate().try_for_each(|(r, t)| {
                t.tree.check(depth, nodes, self.vocab_size).map_err(|e| format!("row {r}: {e}"))?;
                match &t.probabilities {
                    Some(p) if p.shape() != [t.tree.len() as i32, self.vocab_size as i32] => {
                        Err(format!("row {r}: probabilities of shape {:?} for {} nodes", p.shape(), t.tree.len()))
                    }
                    _ => Ok(()),
                }
            })
        };
        checked.map(|()| Some(trees)).map_err(|reason| {
            self.poisoned = true;
            DrafterError::InvalidAnswer { kind: self.kind.clone(), call: "draft_tree", reason }
        })
    }

    /// Refuses device drafts, once read, whose ids fall outside the vocabulary.
    pub fn check_device_drafts(&mut self, tokens: &[u32]) -> Result<(), DrafterError> {
        let Some(&bad) = tokens.iter().find(|&&t| t >= self.vocab_size) else { return Ok(()) };
        self.poisoned = true;
        let reason = format!("token id {bad} outside the vocabulary of {}", self.vocab_size);
        Err(DrafterError::InvalidAnswer { kind: self.kind.clone(), call: "draft_on_device", reason })
    }

    pub fn commit(&mut self, window: &[u32], accepted: &[u32], context: Option<&Array>) -> Result<(), DrafterError> {
        self.live()?;
        let answer = self
            .group
            .commit(TokenRows::new(window, self.rows), accepted.into(), context.map(ArrayRef::new).into())
            .into_result();
        self.checked("commit", answer)
    }

    /// Keeps only the listed rows, in that order.
    pub fn filter_rows(&mut self, keep: &[u32]) -> Result<(), DrafterError> {
        self.live()?;
        let answer = self.group.filter_rows(keep.into()).into_result();
        self.checked("filter_rows", answer)?;
        self.rows = keep.len();
        Ok(())
    }

    /// A snapshot of one row, which `append` restores (in this group or another).
    pub fn capture(&mut self, row: usize) -> Result<RowState, DrafterError> {
        self.live()?;
        let answer = self.group.capture(row as u32).into_result();
        self.checked("capture", answer)
    }

    /// Adds rows restored from captured states after the existing ones.
    pub fn append(&mut self, states: Vec<RowState>) -> Result<(), DrafterError> {
        self.live()?;
        let added = states.len();
        let answer = self.group.append(states.into()).into_result();
        self.checked("append", answer)?;
        self.rows += added;
        Ok(())
    }

    fn live(&self) -> Result<(), DrafterError> {
        if self.poisoned {
            return Err(DrafterError::Poisoned { kind: self.kind.clone() });
        }
        Ok(())
    }

    /// A failed call leaves the drafter's state unknown, so it is not called again; a call it
    /// answers as unsupported (a row group that cannot capture its rows) changed nothing.
    fn checked<T>(&mut self, call: &'static str, answer: Result<T, PluginError>) -> Result<T, DrafterError> {
        answer.map_err(|error| {
            self.poisoned |= error.kind != plugin_api::ErrorKind::UNSUPPORTED;
            DrafterError::Plugin { kind: self.kind.clone(), call, error }
        })
    }

    fn validate_draft(&self, rows: RVec<plugin_api::abi::DraftRow>, depth: usize) -> Result<Vec<Proposal>, String> {
        if rows.len() != self.rows {
            return Err(format!("{} proposals for {} rows", rows.len(), self.rows));
        }
        rows.into_iter()
            .enumerate()
            .map(|(r, row)| {
                if row.tokens.len() > depth {
                    return Err(format!("row {r}: {} tokens for a depth of {depth}", row.tokens.len()));
                }
                if let Some(&bad) = row.tokens.iter().find(|&&t| t >= self.vocab_size) {
                    return Err(format!("row {r}: token id {bad} outside the vocabulary of {}", self.vocab_size));
                }
                let probabilities = match row.probabilities {
                    ROption::RSome(p) => {
                        let p = p.into_array();
                        let want = [row.tokens.len() as i32, self.vocab_size as i32];
                        if p.shape() != want {
                            return Err(format!("row {r}: probabilities of shape {:?}, expected {want:?}", p.shape()));
                        }
                        Some(p)
                    }
                    ROption::RNone => None,
                };
                Ok(Proposal { tokens: row.tokens.into_vec(), probabilities })
            })
            .collect()
    }
}
