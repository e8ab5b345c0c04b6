//! What moves a position's logits before its token is chosen, by the tokens before it:
//! OpenAI's `frequency_penalty` and `presence_penalty` (over the generated tokens),
//! `logit_bias`, and mlx-lm's `repetition_penalty` (over the last tokens of prompt and output).
//! A position's logits depend only on the tokens it extends, so a verify window applies to each
//! position the penalties of exactly its prefix, and speculative output stays plain decoding's.

use serde::{Deserialize, Serialize};

/// The tokens of context mlx-lm's repetition penalty looks back over by default.
pub const REPETITION_CONTEXT: usize = 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Penalties {
    /// Subtracted from a token's logit once per time it was generated (OpenAI, −2 to 2).
    pub frequency_penalty: f32,
    /// Subtracted from a token's logit once it was generated at all (OpenAI, −2 to 2).
    pub presence_penalty: f32,
    /// Divides positive logits and multiplies negative ones of the tokens among the last
    /// `repetition_context_size` of prompt and output (mlx-lm); 1 leaves them.
    pub repetition_penalty: f32,
    pub repetition_context_size: usize,
    /// (token id, bias) added to the logit; −100 bans the token in practice (OpenAI, −100 to 100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Penalties {
        Penalties {
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            repetition_context_size: REPETITION_CONTEXT,
            logit_bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// Whether any logit is moved.
    pub fn any(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || (self.repetition_penalty != 1.0 && self.repetition_context_size > 0)
            || !self.logit_bias.is_empty()
    }

    /// The first value out of range (ranges as OpenAI documents them): its field, and why.
    pub fn validate(&self, vocab: usize) -> Result<(), (&'static str, String)> {
        for (name, value) in
            [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return Err((name, format!("must be from -2 to 2, got {value}")));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(("repetition_penalty", format!("must be a number above 0, got {}", self.repetition_penalty)));
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab {
                return Err(("logit_bias", format!("token id {id} is outside the vocabulary of {vocab}")));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(("logit_bias", format!("the bias of token {id} must be from -100 to 100, got {bias}")));
            }
        }
        Ok(())
    }

    /// A `logit_bias` as JSON and TOML give it, token ids as keys: the pairs, or why not.
    pub fn parse_logit_bias<'a>(
        entries: impl IntoIterator<Item = (&'a String, &'a f32)>,
    ) -> Result<Vec<(u32, f32)>, String> {
        entries
            .into_iter()
            .map(|(id, &bias)| match id.trim().parse::<u32>() {
                Ok(id) => Ok((id, bias)),
                Err(_) => Err(format!("`{id}` is not a token id")),
            })
            .collect()
    }

    /// Moves `logits` [V] of the position after `prompt` and `generated`.
    pub fn apply(&self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= n as f32 * self.frequency_penalty + self.presence_penalty;
                }
            }
        }
        if self.repetition_penalty != 1.0 {
            let from_output = generated.len().min(self.repetition_context_size);
            let from_prompt = (self.repetition_context_size - from_output).min(prompt.len());
            let recent = prompt[prompt.len() - from_prompt..].iter().chain(&generated[generated.len() - from_output..]);
            let mut seen = std::collections::HashSet::new();
            for &t in recent {
                if let (true, Some(l)) = (seen.insert(t), logits.get_mut(t as usize)) {
                    *l = if *l < 0.0 { *l * self.repetition_penalty } else { *l / self.repetition_penalty };
                }
            }
        }
        for &(t, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_control_moves_the_logits_as_defined() {
        let logits = [1.0, -1.0, 2.0, 0.5];
        let moved = |p: Penalties, prompt: &[u32], generated: &[u32]| {
            let mut l = logits;
            p.apply(&mut l, prompt, generated);
            l
        };
        let none = Penalties::default();
        assert!(!none.any());
        assert_eq!(moved(none.clone(), &[0, 1], &[2, 2]), logits);
        // Frequency: per occurrence in the output; presence: once. The prompt does not count.
        let f = Penalties { frequency_penalty: 0.5, presence_penalty: 0.25, ..none.clone() };
        assert_eq!(moved(f, &[3, 3], &[2, 2, 0]), [0.25, -1.0, 0.75, 0.5]);
        // Repetition over the last 3 tokens of prompt and output: positive logits divided,
        // negative multiplied, each token once.
        let r = Penalties { repetition_penalty: 2.0, repetition_context_size: 3, ..none.clone() };
        assert_eq!(moved(r, &[0, 1, 3], &[1, 1]), [1.0, -2.0, 2.0, 0.25]);
        let b = Penalties { logit_bias: vec![(1, 3.0), (2, -100.0)], ..none };
        assert_eq!(moved(b, &[], &[]), [1.0, 2.0, -98.0, 0.5]);
    }

    #[test]
    fn values_out_of_range_are_refused_by_name() {
        let p = |f: fn(&mut Penalties)| {
            let mut p = Penalties::default();
            f(&mut p);
            let (field, why) = p.validate(10).unwrap_err();
            format!("{field}: {why}")
        };
        assert_eq!(p(|p| p.frequency_penalty = 2.5), "frequency_penalty: must be from -2 to 2, got 2.5");
        assert_eq!(p(|p| p.presence_penalty = -3.0), "presence_penalty: must be from -2 to 2, got -3");
        assert_eq!(p(|p| p.repetition_penalty = 0.0), "repetition_penalty: must be a number above 0, got 0");
        assert_eq!(p(|p| p.logit_bias = vec![(10, 1.0)]), "logit_bias: token id 10 is outside the vocabulary of 10");
        assert_eq!(
            p(|p| p.logit_bias = vec![(3, 101.0)]),
            "logit_bias: the bias of token 3 must be from -100 to 100, got 101"
        );
        let map: std::collections::BTreeMap<String, f32> = [("7".to_owned(), -100.0)].into();
        assert_eq!(Penalties::parse_logit_bias(&map), Ok(vec![(7, -100.0)]));
        let bad: std::collections::BTreeMap<String, f32> = [("seven".to_owned(), 1.0)].into();
        assert_eq!(Penalties::parse_logit_bias(&bad), Err("`seven` is not a token id".to_owned()));
    }
}
