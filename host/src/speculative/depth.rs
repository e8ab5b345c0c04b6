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
//! | 1 | 1.27× | 1.50× | 1.64× | 1.69× | 1.71× | 1.63× |
//! | 2 | 1.34× | 1.49× | 1.53× | 1.50× | 1.48× | 1.23× |
//! | 3 | 1.15× | 1.38× | 1.41× | 1.36× | 1.17× | 1.11× |
//! | 4 | 1.23× | 1.23× | 1.22× | 1.08× | 0.98× | 0.84× |
//! | 8 | 1.03× | 0.96× | 0.92× | 0.80× | 0.72× | 0.62× |
//! | 16 | 0.92× | 0.85× | 0.78× | 0.71× | 0.52× | 0.46× |
//!
//! So 4 tokens for one row (γ 6 gains 1% more and costs more under load), 3 for two or three,
//! 2 for four, and none from five on, where the best length gained 3% at eight rows and lost
//! at sixteen.

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
