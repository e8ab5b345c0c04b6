//! `draft_tokens = "auto"`: how many tokens each row drafts in a round, by how many rows share
//! it. A verify window costs the target a row of work per drafted position whether or not the
//! draft is kept. Alone, a row leaves the target's memory-bound step half idle and drafting
//! fills it; in a batch of three or more the target's step is busy already, and the same drafts cost
//! more than they save.
//!
//! Measured with `host bench --serving` on the demo target and its trained DFlash drafter
//! (README, "Draft length under load"): the best γ was 3 for one request (1.43× plain), 2 for
//! two (1.29×); γ = 2 lost at three (0.94×), and no γ from 1 to 4 beat plain decoding at four,
//! eight or sixteen. Measured again once the drafter drafted every row in one pass: γ 2–4 gave
//! 1.35–1.50× at one request and 1.11–1.19× at two, 0.98–1.02× at three and 0.90–1.06× at four
//! (within the noise of plain decoding), 0.75–0.82× at eight.

/// The most tokens a row drafts under "auto" (the caches' rollback room is sized for it).
pub const AUTO_MOST: usize = 3;

use super::SpecConfig;

/// The draft length for a round of `rows` rows (0: the round verifies only the pending token).
pub fn auto_draft_tokens(rows: usize) -> usize {
    match rows {
        0..=1 => 3,
        2 => 2,
        _ => 0,
    }
}

impl SpecConfig {
    /// The config of a round that `rows` rows share: under "auto", no deeper than
    /// [`auto_draft_tokens`] of them.
    pub fn for_rows(mut self, auto: bool, rows: usize) -> SpecConfig {
        if auto {
            self.draft_tokens = self.draft_tokens.min(auto_draft_tokens(rows));
        }
        self
    }
}

/// The draft length as reports print it: "3", or "auto (up to 3)".
pub fn describe_draft_tokens(auto: bool, most: usize) -> String {
    if auto {
        format!("auto (up to {most})")
    } else {
        most.to_string()
    }
}
