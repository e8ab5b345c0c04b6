//! `draft_tokens = "auto"`: how many tokens each row drafts in a round, by how many rows share
//! it. A verify window costs the target a row of work per drafted position whether or not the
//! draft is kept. Alone, a row leaves the target's step mostly idle (fixed costs and weight
//! reads) and drafting fills it; the more rows share a round, the busier the step is already,
//! and the less a drafted position saves against what it costs.
//!
//! The lengths follow the speed-ups over plain decoding that
//! `host bench --serving 1,2,3,4,8,16 --draft-tokens γ` gives on the demo target with the lookup
//! drafter, the default manifest's (docs/performance.md has them): 4 tokens for one row, where
//! longer drafts gain next to nothing alone and cost far more once rows share the round; 3 for
//! two or three rows, where a fourth gains next to nothing; 2 for four; and none from five on,
//! where the best length gains little at eight rows and loses at sixteen.

/// The most tokens a row drafts under "auto" (the caches' rollback room is sized for it).
pub const AUTO_MOST: usize = 4;

use super::SpecConfig;

/// The draft length for a round of `rows` rows (0: the round verifies only the pending token).
pub fn auto_draft_tokens(rows: usize) -> usize {
    match rows {
        0..=1 => 4,
        2..=3 => 3,
        4 => 2,
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

/// The draft length as reports print it: "3", or "auto (up to 4)".
pub fn describe_draft_tokens(auto: bool, most: usize) -> String {
    if auto {
        format!("auto (up to {most})")
    } else {
        most.to_string()
    }
}
