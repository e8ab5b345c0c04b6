//! `draft_tokens = "auto"`: how many tokens each row drafts in a round, by how many rows share
//! it. A verify window costs the target a row of work per drafted position whether or not the
//! draft is kept. Alone, a row leaves the target's step mostly idle (fixed costs and weight
//! reads) and drafting fills it; the more rows share a round, the busier the step is already,
//! and the less a drafted position saves against what it costs.
//!
//! Measured with `host bench --serving` on the demo target with prompt lookup, the embedded
//! default (README, "Draft length under load"; 2 pairs, speed-up over plain decoding):
//!
//! | rows | γ = 1 | γ = 2 | γ = 3 |
//! |---|---|---|---|
//! | 1 | 1.32× | 1.43× | 1.44× |
//! | 2 | 1.26× | 1.30× | 1.16× |
//! | 3 | 1.12× | 1.07× | 1.02× |
//! | 4 | 1.12–1.14× | 1.07–1.08× | 1.02–1.05× |
//! | 8 | 0.98–1.04× | 1.09× | 0.93× |
//! | 16 | 0.93× | 0.96× | 0.79× |
//!
//! So 3 tokens for one row, 2 for two, 1 for three or four, and none from five on, where no
//! length gained more than the noise.

/// The most tokens a row drafts under "auto" (the caches' rollback room is sized for it).
pub const AUTO_MOST: usize = 3;

use super::SpecConfig;

/// The draft length for a round of `rows` rows (0: the round verifies only the pending token).
pub fn auto_draft_tokens(rows: usize) -> usize {
    match rows {
        0..=1 => 3,
        2 => 2,
        3..=4 => 1,
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
