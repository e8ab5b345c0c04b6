//! The exported root module and the objects a plugin hands to the host.
//!
//! Plugin authors do not implement these directly: the SDK ([`crate::sdk`]) adapts plain Rust
//! traits to them and guards every entry against panics.

use abi_stable::library::RootModule;
use abi_stable::sabi_trait;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, StableAbi};

pub use crate::extension::Extension;
use crate::target::TargetViewBox;
use crate::{ArrayRef, Descriptor, OwnedArray, PluginError, ProviderInfo};

/// The one symbol a plugin exports. Frozen: it grows only through [`DrafterRoot::extension`].
/// **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = DrafterRootRef)))]
#[sabi(missing_field(panic))]
pub struct DrafterRoot {
    pub descriptor: extern "C" fn() -> RResult<Descriptor, PluginError>,
    /// Loads an artifact (`""` when the drafter needs none) with the manifest's `[drafter]`
    /// options for this plugin, as TOML text.
    pub load: extern "C" fn(artifact: RStr<'_>, options: RStr<'_>) -> RResult<ProviderBox, PluginError>,
    /// Looks up an extension by versioned id (`"name/1"`); `RNone` when the plugin has none.
    #[sabi(last_prefix_field)]
    pub extension: extern "C" fn(id: RStr<'_>) -> ROption<Extension>,
}

impl RootModule for DrafterRootRef {
    declare_root_module_statics! {DrafterRootRef}
    const BASE_NAME: &'static str = "drafter";
    const NAME: &'static str = "drafter";
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(crate::API_VERSION);
}

/// Token ids of B rows of equal length, row-major. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct TokenRows<'a> {
    pub ids: RSlice<'a, u32>,
    pub rows: u32,
    pub len: u32,
}

impl<'a> TokenRows<'a> {
    pub fn new(ids: &'a [u32], rows: usize) -> Self {
        let len = ids.len().checked_div(rows).unwrap_or(0);
        assert_eq!(len * rows, ids.len(), "token rows must have equal length");
        TokenRows { ids: ids.into(), rows: rows as u32, len: len as u32 }
    }
    pub fn row(&self, r: usize) -> &'a [u32] {
        let len = self.len as usize;
        &self.ids.as_slice()[r * len..(r + 1) * len]
    }
}

/// One row's proposal. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct DraftRow {
    /// 0..=depth token ids; none is a legal answer (the round becomes one plain step).
    pub tokens: RVec<u32>,
    /// [tokens.len(), V] probabilities the tokens were drawn from, when asked for.
    pub probabilities: ROption<OwnedArray>,
}

/// A snapshot of one row's drafter state at an exact token boundary. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct RowState {
    /// The provider's namespace; a state is only appended to groups of the same namespace.
    pub namespace: RString,
    /// Tokens of this row the state covers.
    pub processed: u64,
    pub ids: RVec<u32>,
    pub tensors: RVec<OwnedArray>,
}

/// A loaded artifact. **ABI-frozen.**
#[sabi_trait]
pub trait ProviderAbi {
    fn info(&self) -> ProviderInfo;

    /// Opens `rows` empty rows against a target; refuses an incompatible target here, before
    /// any generation.
    #[sabi(last_prefix_field)]
    fn open(&self, target: TargetViewBox, rows: u32) -> RResult<RowGroupBox, PluginError>;
}

/// B rows of drafter state, driven by the host's verify loop. **ABI-frozen.**
#[sabi_trait]
pub trait RowGroupAbi {
    /// New prompt tokens of every row (equal length) with their `context`: the target's hidden
    /// states at the drafter's tap layers, concatenated [B, N, taps·H], or, when it declared
    /// none, the target's final (normed) hidden states [B, N, H].
    fn prefill(&mut self, tokens: TokenRows<'_>, context: ROption<ArrayRef<'_>>) -> RResult<(), PluginError>;

    /// Proposes 0..=depth tokens per row after each row's `pending` token; `steps[r]` is the
    /// index of the token row r emits next (for per-step random keys).
    fn draft(
        &mut self,
        pending: RSlice<'_, u32>,
        depth: u32,
        steps: RSlice<'_, u64>,
    ) -> RResult<RVec<DraftRow>, PluginError>;

    /// The verify window [B, W] = [pending, drafts…] (right-padded) was checked: row r keeps
    /// window positions `0..=accepted[r]`. `context` is that window's context, as in `prefill`.
    fn commit(
        &mut self,
        window: TokenRows<'_>,
        accepted: RSlice<'_, u32>,
        context: ROption<ArrayRef<'_>>,
    ) -> RResult<(), PluginError>;

    /// Keeps only the listed rows, in that order.
    fn filter_rows(&mut self, keep: RSlice<'_, u32>) -> RResult<(), PluginError>;

    /// Adds rows restored from captured states, after the existing rows.
    fn append(&mut self, states: RVec<RowState>) -> RResult<(), PluginError>;

    /// A snapshot of one row, which `append` restores.
    #[sabi(last_prefix_field)]
    fn capture(&mut self, row: u32) -> RResult<RowState, PluginError>;
}

pub type ProviderBox = ProviderAbi_TO<'static, RBox<()>>;
pub type RowGroupBox = RowGroupAbi_TO<'static, RBox<()>>;
