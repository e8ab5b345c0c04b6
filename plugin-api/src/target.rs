//! The host's side of the seam: what a drafter may ask of the target model.

use abi_stable::sabi_trait;
use abi_stable::std_types::{RBox, ROption, RResult, RStr, RString, RVec};
use abi_stable::StableAbi;

use crate::{ArrayRef, OwnedArray, PluginError};

/// Sizes and kinds of the target a drafter is opened against. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TargetInfo {
    /// The checkpoint's `model_type` (e.g. `gemma4_text`).
    pub model_type: RString,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_attention_heads: u32,
    pub num_key_value_heads: u32,
    /// Head dim of the sliding layers.
    pub head_dim: u32,
    /// Head dim of the full-attention layers.
    pub global_head_dim: u32,
    /// Per layer, whether it attends over a sliding window or the full context.
    pub layer_kinds: RVec<LayerKind>,
    /// Layers from this index on reuse a donor's K/V instead of keeping their own.
    pub first_kv_shared_layer: u32,
    /// Sliding-window length of the sliding layers; 0 when the target has none.
    pub sliding_window: u32,
    /// The activation dtype, as mlx-c's `mlx_dtype` number.
    pub dtype: u32,
    /// `final_logit_softcapping`; 0 when off.
    pub final_logit_softcap: f32,
}

/// How a target layer attends. **ABI-frozen** (a `u8`).
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Debug)]
pub struct LayerKind(pub u8);

impl LayerKind {
    pub const SLIDING: Self = Self(0);
    pub const FULL: Self = Self(1);
}

/// The K/V of one donor layer, lent as new references to the target's cache arrays (no copy).
/// **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct DonorLayer {
    /// [B, kv_heads, slots, head_dim], in the cache's storage order.
    pub keys: OwnedArray,
    /// Same shape as `keys`.
    pub values: OwnedArray,
    /// [B, slots] int32: the absolute position held by each slot, -1 for an empty slot. A
    /// rotating cache's slots are not in position order; this says which is which.
    pub slot_positions: OwnedArray,
    /// The attention window of this layer; 0 for full attention.
    pub window: u32,
}

/// The target's last sliding and last full donor layers, for drafters that attend to the
/// target's cache instead of keeping one. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct Donors {
    /// Per row, the target's last cached position.
    pub positions: RVec<i32>,
    pub sliding: DonorLayer,
    pub full: DonorLayer,
}

/// Callbacks into the target. The host implements it; a row group keeps it for its lifetime.
/// Calls happen on the thread that drives the row group. **ABI-frozen**: its methods never
/// change and none are added; newer ports come through [`extension`](Self::extension).
#[sabi_trait]
pub trait TargetViewAbi {
    fn info(&self) -> TargetInfo;

    /// Token embeddings [B, L, H] of ids [B, L]; `scaled` multiplies by √H as the target's
    /// own input does.
    fn embed(&self, ids: ArrayRef<'_>, scaled: bool) -> RResult<OwnedArray, PluginError>;

    /// Logits [B, L, V] of hidden states [B, L, H]: the tied head, then the final softcap.
    fn logits_from_hidden(&self, hidden: ArrayRef<'_>) -> RResult<OwnedArray, PluginError>;

    fn read_donors(&self) -> RResult<Donors, PluginError>;

    /// A host extension by versioned id (`"name/1"`), for ports newer than this trait: the
    /// trait itself never grows, so plugins and hosts of different minors keep loading each
    /// other. `RNone` when the host has none.
    #[sabi(last_prefix_field)]
    fn extension(&self, id: RStr<'_>) -> ROption<crate::extension::Extension>;
}

/// A target view owned by whoever holds it.
pub type TargetViewBox = TargetViewAbi_TO<'static, RBox<()>>;
