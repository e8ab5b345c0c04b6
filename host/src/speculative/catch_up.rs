//! Tokens the drafter has not been shown yet. A round that drafts nothing (`draft_tokens =
//! "auto"` once enough rows share the rounds) would still pay the drafter's commit of every
//! row's token and hidden states; instead they wait here, and the drafter takes them all in
//! one prefill (every row the same number of tokens, with their context) before it next
//! drafts or its rows change.

use mlx_rs::Array;

use super::slot::DrafterSlot;
use crate::generate::GenerateError;

/// Rounds kept before the drafter is caught up regardless, so that what waits stays small.
const MOST_ROUNDS: usize = 64;

#[derive(Default)]
pub(super) struct CatchUp {
    /// Per round, each row's committed token.
    tokens: Vec<Vec<u32>>,
    /// Per round, the context of those tokens [B, 1, …], when the drafter takes one.
    contexts: Vec<Array>,
}

impl CatchUp {
    /// Keeps one round's tokens (one per row) and their context.
    pub(super) fn push(
        &mut self,
        tokens: Vec<u32>,
        context: Option<Array>,
        slot: &mut DrafterSlot,
    ) -> Result<(), GenerateError> {
        if !matches!(slot, DrafterSlot::Active(_)) {
            // Plain decoding, or a drafter dropped: nobody to catch up.
            return Ok(());
        }
        self.tokens.push(tokens);
        self.contexts.extend(context);
        if self.tokens.len() >= MOST_ROUNDS {
            self.flush(slot)?;
        }
        Ok(())
    }

    /// Shows the drafter every token kept, row by row, in one prefill.
    pub(super) fn flush(&mut self, slot: &mut DrafterSlot) -> Result<(), GenerateError> {
        let Some(rows) = self.tokens.first().map(Vec::len) else { return Ok(()) };
        let flat: Vec<u32> = (0..rows).flat_map(|r| self.tokens.iter().map(move |round| round[r])).collect();
        let context = match self.contexts.len() {
            0 => None,
            _ => Some(mlx_rs::ops::concatenate(&self.contexts, 1)?),
        };
        self.clear();
        slot.call(|g| g.prefill(&flat, context.as_ref()));
        Ok(())
    }

    /// Forgets what was kept (the batch emptied: its drafter goes with it).
    pub(super) fn clear(&mut self) {
        self.tokens.clear();
        self.contexts.clear();
    }
}
