//! The extension `device-draft/1` (since API 1.1): proposals that stay on the device.
//!
//! `RowGroupAbi::draft` answers token ids in host memory, so a drafter that computes on a GPU
//! waits for its proposal before the host can build the verify forward on it, and the host
//! then waits again for the target's tokens: two round trips a round, with the device idle
//! between them. Through this extension a row group answers its proposal as an array the device
//! may still be computing; the host builds the verify forward on that array and waits once, for
//! drafts and verification together.
//!
//! The SDK exports the table for every drafter; a group answers `RNone` (and the host calls
//! `draft`) unless its [`GroupedDraftProvider::draft_on_device`](crate::sdk::GroupedDraftProvider)
//! says otherwise. The host asks only where MLX computes off the CPU loops' route and the round
//! needs no draft probabilities.

use abi_stable::std_types::{ROption, RResult, RSlice};
use abi_stable::StableAbi;

use crate::abi::RowGroupBox;
use crate::{OwnedArray, PluginError};

/// The id under which a plugin offers [`DeviceDraft`].
pub const DEVICE_DRAFT_ID: &str = "device-draft/1";

/// The extension [`DEVICE_DRAFT_ID`]. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi)]
pub struct DeviceDraft {
    /// `draft` of `group`, a group this library opened, with exactly `depth` (≥ 1) tokens per
    /// row: token ids [B, depth], int32 or uint32, which may still be computing. The same
    /// rules as `draft`: the committed state does not change, `steps` is the only randomness,
    /// and the tokens are those `draft` would propose. `RNone`: this group drafts through
    /// `draft` this round.
    pub draft: extern "C" fn(
        group: &mut RowGroupBox,
        pending: RSlice<'_, u32>,
        depth: u32,
        steps: RSlice<'_, u64>,
    ) -> RResult<ROption<OwnedArray>, PluginError>,
}
