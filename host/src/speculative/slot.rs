//! The drafter of a batch, or why it was dropped. A drafter that fails or breaks the contract
//! is dropped here, in one place, and the batch finishes by plain decoding.

use crate::plugin::drafter::DrafterGroup;
use crate::plugin::DrafterError;

pub(super) enum DrafterSlot {
    Active(DrafterGroup),
    Dropped(String),
}

impl DrafterSlot {
    /// Calls the drafter while it is active; an error drops it, keeping why.
    pub(super) fn call<T>(&mut self, call: impl FnOnce(&mut DrafterGroup) -> Result<T, DrafterError>) -> Option<T> {
        let DrafterSlot::Active(rows) = self else { return None };
        match call(rows) {
            Ok(value) => Some(value),
            Err(e) => {
                *self = DrafterSlot::Dropped(e.to_string());
                None
            }
        }
    }

    /// Why the drafter was dropped, if it was.
    pub(super) fn dropped_reason(&self) -> Option<String> {
        match self {
            DrafterSlot::Active(_) => None,
            DrafterSlot::Dropped(reason) => Some(reason.clone()),
        }
    }
}
