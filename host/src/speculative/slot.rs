//! The drafter of a batch, or why it was dropped. A drafter that fails or breaks the contract
//! is dropped here, in one place, and the batch finishes by plain decoding.

use crate::plugin::drafter::DrafterGroup;
use crate::plugin::DrafterError;

pub(super) enum DrafterSlot {
    Active(DrafterGroup),
    Dropped(String),
    /// No drafter was configured: plain decoding through the same loop.
    Absent,
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

    /// The slot of a batch that `other`'s one row joins: the rows of `other`'s drafter are
    /// appended to this one's. A failure on either side drops the drafter for the whole batch.
    pub(super) fn join(self, other: DrafterSlot) -> DrafterSlot {
        match (self, other) {
            (DrafterSlot::Active(mut group), DrafterSlot::Active(mut one)) => {
                match one.capture(0).and_then(|state| group.append(vec![state])) {
                    Ok(()) => DrafterSlot::Active(group),
                    Err(e) => DrafterSlot::Dropped(e.to_string()),
                }
            }
            (DrafterSlot::Active(_), DrafterSlot::Dropped(reason)) => DrafterSlot::Dropped(reason),
            (slot, _) => slot,
        }
    }

    /// Why the drafter was dropped, if it was.
    pub(super) fn dropped_reason(&self) -> Option<String> {
        match self {
            DrafterSlot::Dropped(reason) => Some(reason.clone()),
            _ => None,
        }
    }
}
