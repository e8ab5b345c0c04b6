//! `draft_tokens = "auto"`: how many tokens each row drafts in a round, by how many rows share
//! it. A verify window costs the target a row of work per drafted position whether or not the
//! draft is kept. Alone, a row leaves the target's step mostly idle (fixed costs and weight
//! reads) and drafting fills it; the more rows share a round, the busier the step is already,
//! and the less a drafted position saves against what it costs.
//!
//! Measured with `host bench --serving 1,2,3,4,8,16 --draft-tokens γ` on the demo target with
//! the lookup drafter, the embedded default (README, "Draft length under load"; 16 requests of
//! 128 tokens, 3 pairs, speed-up over plain decoding, medians):
//!
//! | rows | γ = 1 | γ = 2 | γ = 3 | γ = 4 | γ = 6 | γ = 8 |
//! |---|---|---|---|---|---|---|
//! | 1 | 1.29× | 1.61× | 1.68× | 1.75× | 1.74× | 1.76× |
//! | 2 | 1.33× | 1.55× | 1.56× | 1.58× | 1.45× | 1.27× |
//! | 3 | 1.26× | 1.42× | 1.42× | 1.40× | 1.23× | 1.12× |
//! | 4 | 1.19× | 1.29× | 1.24× | 1.09× | 1.04× | 0.92× |
//! | 8 | 1.04× | 0.97× | 0.92× | 0.83× | 0.71× | 0.64× |
//! | 16 | 0.89× | 0.86× | 0.77× | 0.71× | 0.54× | 0.48× |
//!
//! So 4 tokens for one row (γ 8 gains 1% more and costs far more under load), 3 for two or
//! three (γ 4 gains 1% at two), 2 for four, and none from five on, where the best length gained
//! 4% at eight rows and lost at sixteen.

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
