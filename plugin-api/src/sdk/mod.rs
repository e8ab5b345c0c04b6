//! The SDK: a drafter author implements [`Drafter`] (the kind), [`DraftProvider`] (a loaded
//! artifact) and either [`DraftSource`] (one row; [`SourceRows`] makes the group) or
//! [`GroupedDraftProvider`] (B rows driven by the verify loop) in plain Rust, and exports them
//! with [`export_drafter!`](crate::export_drafter). The adapters here turn them into the ABI
//! objects ([`ProviderAbi`], [`RowGroupAbi`]) and guard every entry: a panic becomes a
//! [`PluginError`] of kind `PANICKED` instead of crossing the boundary.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Once;

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::sabi_trait::{TD_CanDowncast, TD_Opaque};
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RVec};
use mlx_rs::Array;
use serde::de::DeserializeOwned;

use crate::abi::{
    DraftRow, DrafterRoot, DrafterRootRef, Extension, ProviderAbi, ProviderAbi_TO, ProviderBox, RowGroupAbi,
    RowGroupAbi_TO, RowGroupBox, RowState, TokenRows,
};
use crate::device_draft::{DeviceDraft, DEVICE_DRAFT_ID};
use crate::draft_tree::{DraftTree, Tree, TreeRow, DRAFT_TREE_ID};
use crate::target::{Donors, TargetInfo, TargetViewBox};
use crate::{ArrayRef, Descriptor, ErrorKind, OwnedArray, PluginError, ProviderInfo};

/// A drafter kind: its descriptor, and how it loads an artifact.
pub trait Drafter: 'static {
    type Provider: DraftProvider;
    fn descriptor() -> Descriptor;
    /// `artifact` is `None` when the manifest names none. `options` holds only keys the
    /// descriptor declares (the SDK refuses others before calling this).
    fn load(artifact: Option<&Path>, options: &Options) -> Result<Self::Provider, PluginError>;
    /// An extension table by versioned id (`"name/1"`), for features newer than the frozen
    /// root; build it with [`Extension::of`]. None by default.
    fn extension(_id: &str) -> Option<Extension> {
        None
    }
}

/// A loaded artifact, from which row groups are opened against a target.
pub trait DraftProvider: 'static {
    type Rows: GroupedDraftProvider;
    /// The artifact's id, size, state namespace and concrete capabilities.
    fn info(&self) -> ProviderInfo;
    /// Opens `rows` empty rows. Refuse an incompatible target here, naming both values.
    fn open(&self, target: Target, rows: usize) -> Result<Self::Rows, PluginError>;
}

/// B rows of drafter state, driven by the host's verify loop (see
/// [`RowGroupAbi`] for the contract of each call). Drafters whose rows
/// are independent implement [`DraftSource`] instead and use [`SourceRows`].
pub trait GroupedDraftProvider: 'static {
    /// Every row's new prompt tokens (equal length), with their context.
    fn prefill(&mut self, tokens: TokenRows<'_>, context: Option<Array>) -> Result<(), PluginError>;
    /// Up to `depth` tokens per row after its `pending` token, without changing committed
    /// state; `steps[r]` is row r's output index, the only source of randomness.
    fn draft(&mut self, pending: &[u32], depth: usize, steps: &[u64]) -> Result<Vec<Proposal>, PluginError>;
    /// What the target kept of each row's window: positions `0..=accepted[r]`.
    fn commit(&mut self, window: TokenRows<'_>, accepted: &[u32], context: Option<Array>) -> Result<(), PluginError>;
    /// Keeps only the listed rows, in that order.
    fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError>;
    /// Adds rows restored from captured states, after the existing ones.
    fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError>;
    /// A snapshot of one row, for another group of the same namespace.
    fn capture(&mut self, row: usize) -> Result<RowState, PluginError>;
    /// [`draft`](Self::draft)'s tokens as one array [B, depth] of exactly `depth` tokens per
    /// row, left for the device to compute (the `device-draft/1` extension): the host builds
    /// its verify forward on them and waits once for both. `None` (the default): draft through
    /// `draft`.
    fn draft_on_device(
        &mut self,
        _pending: &[u32],
        _depth: usize,
        _steps: &[u64],
    ) -> Result<Option<Array>, PluginError> {
        Ok(None)
    }
    /// A tree per row after its `pending` token, at most `nodes` nodes and no path longer than
    /// `depth` (the `draft-tree/1` extension), under [`draft`](Self::draft)'s rules. The host
    /// then commits the accepted path as a chain. `None` (the default): draft chains.
    fn draft_tree(
        &mut self,
        _pending: &[u32],
        _depth: usize,
        _nodes: usize,
        _steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        Ok(None)
    }
}

pub mod lookup;
mod source;
pub use source::{extend_each, taps, ContextDrafter, ContextRow, DraftSource, Snapshot, SourceRows};

/// One row's proposal, in plain Rust.
#[derive(Debug, Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    pub probabilities: Option<Array>,
}

impl Proposal {
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Proposal { tokens, probabilities: None }
    }
}

/// One row's tree, in plain Rust: its nodes and, when the drafter returns probabilities, the
/// distribution each node was drawn from [nodes, V] ([`TreeRow`]).
#[derive(Debug, Default)]
pub struct TreeProposal {
    pub tree: Tree,
    pub probabilities: Option<Array>,
}

impl From<Proposal> for TreeProposal {
    /// A chain's proposal as a tree of one branch.
    fn from(chain: Proposal) -> Self {
        TreeProposal { tree: Tree::chain(&chain.tokens), probabilities: chain.probabilities }
    }
}

/// The drafter's `[drafter]` options from the manifest.
#[derive(Debug, Default)]
pub struct Options {
    table: toml::Table,
}

impl Options {
    pub fn parse(text: &str) -> Result<Self, PluginError> {
        let table = text
            .parse::<toml::Table>()
            .map_err(|e| PluginError::invalid_options(format!("options are not TOML: {e}")))?;
        Ok(Options { table })
    }

    /// The value of `key`, if given; a value of the wrong type is an error naming the key.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, PluginError> {
        self.table
            .get(key)
            .map(|v| v.clone().try_into().map_err(|e| PluginError::invalid_options(format!("option `{key}`: {e}"))))
            .transpose()
    }

    /// The value of `key`: the manifest's, else the default the descriptor declares for it.
    pub fn value<T: DeserializeOwned>(&self, key: &str) -> Result<T, PluginError> {
        self.get(key)?.ok_or_else(|| PluginError::invalid_options(format!("option `{key}` is required")))
    }

    /// The value of `key` as a positive finite number (a temperature, a scale).
    pub fn positive(&self, key: &str) -> Result<f32, PluginError> {
        let v: f32 = self.value(key)?;
        if v > 0.0 && v.is_finite() {
            Ok(v)
        } else {
            Err(PluginError::invalid_options(format!("option `{key}` = {v}: must be positive")))
        }
    }

    /// Fills every option the manifest left out with the descriptor's default (as a manifest
    /// writes the value, a plain word being a string; an empty default means none).
    fn fill_defaults(&mut self, descriptor: &Descriptor) -> Result<(), PluginError> {
        for option in descriptor.options.iter().filter(|o| !o.default.is_empty()) {
            if self.table.contains_key(option.key.as_str()) {
                continue;
            }
            // A default that is no TOML value is a string written plainly (`none`).
            let parsed = format!("value = {}", option.default)
                .parse::<toml::Table>()
                .ok()
                .and_then(|mut t| t.remove("value"))
                .unwrap_or_else(|| toml::Value::String(option.default.to_string()));
            self.table.insert(option.key.to_string(), parsed);
        }
        Ok(())
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.table.keys().map(String::as_str)
    }

    /// Refuses keys the descriptor does not declare.
    fn check_known(&self, descriptor: &Descriptor) -> Result<(), PluginError> {
        let known: BTreeSet<&str> = descriptor.options.iter().map(|o| o.key.as_str()).collect();
        match self.keys().find(|k| !known.contains(k)) {
            None => Ok(()),
            Some(key) => Err(PluginError::invalid_options(format!(
                "unknown option `{key}` for drafter `{}` (known: {})",
                descriptor.kind,
                if known.is_empty() { "none".to_string() } else { known.into_iter().collect::<Vec<_>>().join(", ") }
            ))),
        }
    }
}

/// The target, as a drafter sees it: safe wrappers over the host's callbacks.
pub struct Target {
    view: TargetViewBox,
}

impl Target {
    pub fn new(view: TargetViewBox) -> Self {
        Target { view }
    }
    pub fn info(&self) -> TargetInfo {
        self.view.info()
    }
    pub fn embed(&self, ids: &Array, scaled: bool) -> Result<Array, PluginError> {
        self.view.embed(ArrayRef::new(ids), scaled).into_result().map(OwnedArray::into_array)
    }
    pub fn logits_from_hidden(&self, hidden: &Array) -> Result<Array, PluginError> {
        self.view.logits_from_hidden(ArrayRef::new(hidden)).into_result().map(OwnedArray::into_array)
    }
    pub fn read_donors(&self) -> Result<Donors, PluginError> {
        self.view.read_donors().into_result()
    }
}

/// Picks the token of a draft position from its probabilities, when a drafter samples its
/// drafts (position, probabilities) → token.
pub type Draw<'a> = &'a dyn Fn(usize, &[f32]) -> u32;

pub use crate::random::draw;

/// Set by the host (`--verbose`) to let panics inside plugin entries print as usual.
pub const PANIC_OUTPUT_ENV: &str = "PLUGIN_API_PANIC_OUTPUT";

thread_local! {
    static INSIDE_ENTRY: Cell<bool> = const { Cell::new(false) };
}

/// A panic inside an entry reaches the host as an error carrying its message; the default
/// hook would also print it with a backtrace on the user's terminal. Inside entries the hook
/// stays quiet unless [`PANIC_OUTPUT_ENV`] is set; every other panic (the host's own, when a
/// drafter is built into it) prints as before.
fn install_quiet_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let quiet = INSIDE_ENTRY.with(Cell::get) && std::env::var_os(PANIC_OUTPUT_ENV).is_none();
            if !quiet {
                previous(info);
            }
        }));
    });
}

/// Runs one plugin entry, turning a panic into a `PANICKED` error that names the entry.
pub fn guard<T>(entry: &str, body: impl FnOnce() -> Result<T, PluginError>) -> RResult<T, PluginError> {
    install_quiet_hook();
    let outer = INSIDE_ENTRY.with(|inside| inside.replace(true));
    let outcome = catch_unwind(AssertUnwindSafe(body));
    INSIDE_ENTRY.with(|inside| inside.set(outer));
    match outcome {
        Ok(result) => result.into(),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic payload".into());
            RResult::RErr(PluginError::new(ErrorKind::PANICKED, format!("panicked in {entry}: {what}")))
        }
    }
}

struct ProviderAdapter<P>(P);

impl<P: DraftProvider> ProviderAbi for ProviderAdapter<P> {
    fn info(&self) -> ProviderInfo {
        // `info` cannot return an error; a panic here is turned into an empty id.
        catch_unwind(AssertUnwindSafe(|| self.0.info())).unwrap_or_else(|_| ProviderInfo {
            id: "<panicked in info>".into(),
            weights_bytes: 0,
            namespace: "".into(),
            trained_depth: 0,
            capabilities: Default::default(),
        })
    }

    fn open(&self, target: TargetViewBox, rows: u32) -> RResult<RowGroupBox, PluginError> {
        guard("open", || {
            let group = self.0.open(Target::new(target), rows as usize)?;
            // Downcastable, so that the extensions `device-draft/1` and `draft-tree/1` find the
            // group behind the box.
            Ok(RowGroupAbi_TO::from_value(RowsAdapter(group), TD_CanDowncast))
        })
    }
}

struct RowsAdapter<R>(R);

fn owned(context: ROption<ArrayRef<'_>>) -> Option<Array> {
    context.into_option().map(|c| c.to_array())
}

impl<R: GroupedDraftProvider> RowGroupAbi for RowsAdapter<R> {
    fn prefill(&mut self, tokens: TokenRows<'_>, context: ROption<ArrayRef<'_>>) -> RResult<(), PluginError> {
        guard("prefill", || self.0.prefill(tokens, owned(context)))
    }

    fn draft(
        &mut self,
        pending: RSlice<'_, u32>,
        depth: u32,
        steps: RSlice<'_, u64>,
    ) -> RResult<RVec<DraftRow>, PluginError> {
        guard("draft", || {
            let proposals = self.0.draft(pending.as_slice(), depth as usize, steps.as_slice())?;
            Ok(proposals
                .into_iter()
                .map(|p| DraftRow {
                    tokens: p.tokens.into(),
                    probabilities: p.probabilities.map(OwnedArray::new).into(),
                })
                .collect())
        })
    }

    fn commit(
        &mut self,
        window: TokenRows<'_>,
        accepted: RSlice<'_, u32>,
        context: ROption<ArrayRef<'_>>,
    ) -> RResult<(), PluginError> {
        guard("commit", || self.0.commit(window, accepted.as_slice(), owned(context)))
    }

    fn filter_rows(&mut self, keep: RSlice<'_, u32>) -> RResult<(), PluginError> {
        guard("filter_rows", || self.0.filter_rows(keep.as_slice()))
    }

    fn append(&mut self, states: RVec<RowState>) -> RResult<(), PluginError> {
        guard("append", || self.0.append(states.into_vec()))
    }

    fn capture(&mut self, row: u32) -> RResult<RowState, PluginError> {
        guard("capture", || self.0.capture(row as usize))
    }
}

extern "C" fn descriptor_entry<D: Drafter>() -> RResult<Descriptor, PluginError> {
    guard("descriptor", || Ok(D::descriptor()))
}

extern "C" fn load_entry<D: Drafter>(artifact: RStr<'_>, options: RStr<'_>) -> RResult<ProviderBox, PluginError> {
    guard("load", || {
        let descriptor = D::descriptor();
        let mut options = Options::parse(options.as_str())?;
        options.check_known(&descriptor)?;
        options.fill_defaults(&descriptor)?;
        let artifact = (!artifact.is_empty()).then(|| Path::new(artifact.as_str()));
        let provider = D::load(artifact, &options)?;
        Ok(ProviderAbi_TO::from_value(ProviderAdapter(provider), TD_Opaque))
    })
}

extern "C" fn extension_entry<D: Drafter>(id: RStr<'_>) -> ROption<Extension> {
    // Every plugin takes the host's helper thread for its products.
    if id.as_str() == crate::shared_helper::SHARED_HELPER_ID {
        return ROption::RSome(Extension::of(&crate::shared_helper::SHARED_HELPER_EXTENSION));
    }
    if id.as_str() == DEVICE_DRAFT_ID {
        return ROption::RSome(Extension::of(DeviceDrafts::<<D::Provider as DraftProvider>::Rows>::TABLE));
    }
    if id.as_str() == DRAFT_TREE_ID {
        return ROption::RSome(Extension::of(TreeDrafts::<<D::Provider as DraftProvider>::Rows>::TABLE));
    }
    catch_unwind(|| D::extension(id.as_str())).ok().flatten().into()
}

/// The group behind `group`, a box this SDK made for groups of type `R`.
fn rows_of<'a, R: GroupedDraftProvider>(group: &'a mut RowGroupBox, call: &str) -> Result<&'a mut R, PluginError> {
    match group.obj.downcast_as_mut::<RowsAdapter<R>>() {
        Ok(RowsAdapter(rows)) => Ok(rows),
        Err(_) => Err(PluginError::invalid_argument(format!("{call}: a row group this drafter did not open"))),
    }
}

/// The `device-draft/1` table of the groups of type `R`.
struct DeviceDrafts<R>(std::marker::PhantomData<R>);

impl<R: GroupedDraftProvider> DeviceDrafts<R> {
    const TABLE: &'static DeviceDraft = &DeviceDraft { draft: device_draft_entry::<R> };
}

extern "C" fn device_draft_entry<R: GroupedDraftProvider>(
    group: &mut RowGroupBox,
    pending: RSlice<'_, u32>,
    depth: u32,
    steps: RSlice<'_, u64>,
) -> RResult<ROption<OwnedArray>, PluginError> {
    guard("draft_on_device", || {
        let rows = rows_of::<R>(group, "draft_on_device")?;
        Ok(rows.draft_on_device(pending.as_slice(), depth as usize, steps.as_slice())?.map(OwnedArray::new).into())
    })
}

/// The `draft-tree/1` table of the groups of type `R`.
struct TreeDrafts<R>(std::marker::PhantomData<R>);

impl<R: GroupedDraftProvider> TreeDrafts<R> {
    const TABLE: &'static DraftTree = &DraftTree { draft: draft_tree_entry::<R> };
}

extern "C" fn draft_tree_entry<R: GroupedDraftProvider>(
    group: &mut RowGroupBox,
    pending: RSlice<'_, u32>,
    depth: u32,
    nodes: u32,
    steps: RSlice<'_, u64>,
) -> RResult<ROption<RVec<TreeRow>>, PluginError> {
    guard("draft_tree", || {
        let rows = rows_of::<R>(group, "draft_tree")?;
        let trees = rows.draft_tree(pending.as_slice(), depth as usize, nodes as usize, steps.as_slice())?;
        Ok(trees
            .map(|trees| {
                trees
                    .into_iter()
                    .map(|t| TreeRow {
                        tokens: t.tree.tokens.into(),
                        parents: t.tree.parents.into(),
                        probabilities: t.probabilities.map(OwnedArray::new).into(),
                    })
                    .collect()
            })
            .into())
    })
}

/// The root module for drafter `D`; [`export_drafter!`](crate::export_drafter) exports it.
pub fn root_module<D: Drafter>() -> DrafterRootRef {
    let root =
        DrafterRoot { descriptor: descriptor_entry::<D>, load: load_entry::<D>, extension: extension_entry::<D> };
    root.leak_into_prefix()
}

/// Exports a [`Drafter`] as this library's plugin root: `plugin_api::export_drafter!(MyDrafter);`
/// in a `cdylib` crate. It defines the one symbol the host looks for.
#[macro_export]
macro_rules! export_drafter {
    ($drafter:ty) => {
        #[no_mangle]
        pub static _1as_0lib_1header_0root_bmodule_bloader: $crate::__private::LibHeader = {
            extern "C" fn load_root() -> $crate::__private::RootModuleResult {
                $crate::__private::__call_root_module_loader(|| $crate::sdk::root_module::<$drafter>())
            }
            // SAFETY: the header describes the root module type that `load_root` returns.
            unsafe {
                $crate::__private::LibHeader::from_constructor::<$crate::abi::DrafterRootRef>(
                    load_root,
                    $crate::__private::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_written_as_a_manifest_writes_values_and_a_plain_word_is_a_string() {
        let descriptor = Descriptor::new("k", "k", "0")
            .option("depth", "3", "")
            .option("mode", "none", "")
            .option("quoted", "\"none\"", "")
            .option("greedy", "true", "");
        let mut options = Options::parse("depth = 5").unwrap();
        options.check_known(&descriptor).unwrap();
        options.fill_defaults(&descriptor).unwrap();
        assert_eq!(options.value::<u32>("depth").unwrap(), 5, "the manifest's value stays");
        assert_eq!(options.value::<String>("mode").unwrap(), "none");
        assert_eq!(options.value::<String>("quoted").unwrap(), "none");
        assert!(options.value::<bool>("greedy").unwrap());
    }
}
