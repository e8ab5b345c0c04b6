//! Text ↔ token ids through a checkpoint's `tokenizer.json`.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{file}: {reason}")]
    Load { file: PathBuf, reason: String },
    #[error("tokenizing the prompt: {0}")]
    Encode(String),
    #[error("prompt token id {id} is outside the vocabulary of {vocab}")]
    OutOfVocabulary { id: u32, vocab: u32 },
    #[error("{}: does not fit the model: {}", file.display(), problems.join("; "))]
    Disagrees { file: PathBuf, problems: Vec<String> },
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    file: PathBuf,
}

impl Tokenizer {
    pub fn load(model_dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let file = model_dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| TokenizerError::Load { file: file.clone(), reason: e.to_string() })?;
        Ok(Tokenizer { inner, file })
    }

    /// Tokens the tokenizer knows, its added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// What stops this tokenizer from serving a model of `vocab` token ids whose config names
    /// `special` ids (`eos_token_id`, …): ids the model can emit and the tokenizer cannot
    /// decode would vanish from the text.
    pub fn disagreements(&self, vocab: usize, special: &[(&str, u32)]) -> Vec<String> {
        let mut problems = Vec::new();
        if self.vocab_size() < vocab {
            problems.push(format!(
                "it has {} tokens and the model's vocabulary {vocab}: ids {} to {} would decode to nothing",
                self.vocab_size(),
                self.vocab_size(),
                vocab - 1
            ));
        }
        for (key, id) in special {
            if *id as usize >= vocab || self.inner.id_to_token(*id).is_none() {
                problems.push(format!("config.json's {key} {id} is outside the model's vocabulary or unknown to it"));
            }
        }
        problems
    }

    /// [`Tokenizer::disagreements`] as an error, if there are any.
    pub fn check_fits(&self, vocab: usize, special: &[(&str, u32)]) -> Result<(), TokenizerError> {
        let problems = self.disagreements(vocab, special);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(TokenizerError::Disagrees { file: self.file.clone(), problems })
        }
    }

    /// Ids of `text`, with the tokenizer's own special tokens (e.g. `<bos>`) when it adds them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode(text, true).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids of text that already holds its special tokens, such as a rendered chat template.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Ids the tokenizer knows as end-of-sequence markers.
    pub fn eos_ids(&self) -> Vec<u32> {
        ["<eos>", "<end_of_turn>", "</s>", "<|endoftext|>"].iter().filter_map(|t| self.token_id(t)).collect()
    }
}

/// Turns generated ids into text as they come, so that the pieces streamed add up to exactly
/// the final decode of all ids (invalid bytes as U+FFFD included).
///
/// Not `tokenizers`' `DecodeStream`: it decodes windows of ids, and a byte-fallback decoder
/// turns a run of byte pieces into text as a whole (valid UTF-8, or one U+FFFD per byte), so a
/// window that cuts a run, or a run that turns invalid later, gives text the final decode does
/// not have (the property test below found such sequences). Here a run of byte pieces is held
/// until a piece that is not a byte ends it (special tokens, which decoding skips, do not end
/// it); everything else is decoded as it comes, next to
/// the previous piece so that decoders that treat the first piece apart do not change it.
/// Each step decodes a few ids, so the cost per token does not grow with the length.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// Ids not yet turned into text: an open run of byte pieces, if any.
    pending: Vec<u32>,
    /// The last id already turned into text, decoded as context for the next piece.
    previous: Option<u32>,
    /// Special tokens: decoding skips them, so they neither show nor end a byte run.
    special: std::collections::HashSet<u32>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        let special =
            tokenizer.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id);
        StreamDecoder { tokenizer, ids: Vec::new(), pending: Vec::new(), previous: None, special: special.collect() }
    }

    /// The text `id` completes, possibly empty.
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        self.pending.push(id);
        if self.is_byte_piece(id) || self.special.contains(&id) {
            return String::new();
        }
        self.flush()
    }

    /// The text of the ids still held: call once after the last id.
    pub fn finish(&mut self) -> String {
        self.flush()
    }

    pub fn text(&self) -> String {
        self.tokenizer.decode(&self.ids)
    }

    fn flush(&mut self) -> String {
        if self.pending.is_empty() {
            return String::new();
        }
        let piece = match self.previous {
            None => self.tokenizer.decode(&self.pending),
            Some(previous) => {
                let base = self.tokenizer.decode(&[previous]);
                let mut with_context = vec![previous];
                with_context.extend(&self.pending);
                let text = self.tokenizer.decode(&with_context);
                match text.strip_prefix(&base) {
                    Some(rest) => rest.to_owned(),
                    None => self.tokenizer.decode(&self.pending),
                }
            }
        };
        self.previous = self.pending.last().copied();
        self.pending.clear();
        piece
    }

    fn is_byte_piece(&self, id: u32) -> bool {
        self.tokenizer.inner.id_to_token(id).is_some_and(|t| t.len() == 6 && t.starts_with("<0x") && t.ends_with('>'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo tokenizer: specials, 256 byte-fallback pieces (ids 7..263), then BPE pieces.
    fn demo() -> Tokenizer {
        Tokenizer::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/kjv-gemma4")).unwrap()
    }

    /// Streamed pieces plus the final flush equal the full decode, for random id sequences with
    /// runs of byte-fallback pieces (valid UTF-8 or not), specials and ordinary pieces.
    #[test]
    fn streamed_text_equals_the_final_decode() {
        let tokenizer = demo();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for case in 0..400 {
            let len = 1 + next(40) as usize;
            let ids: Vec<u32> = (0..len)
                .map(|_| match next(10) {
                    0..=3 => 7 + next(256) as u32,      // a byte piece
                    4 => 7 + 0xC2 + next(0x30) as u32,  // a UTF-8 lead byte
                    5 => next(7) as u32,                // a special token
                    _ => 263 + next(8192 - 263) as u32, // a BPE piece
                })
                .collect();
            let mut stream = StreamDecoder::new(&tokenizer);
            let mut streamed: String = ids.iter().map(|&id| stream.push(id)).collect();
            streamed.push_str(&stream.finish());
            assert_eq!(streamed, tokenizer.decode(&ids), "case {case}: ids {ids:?}");
        }
    }

    #[test]
    fn a_character_split_over_byte_pieces_is_streamed_once_whole() {
        let tokenizer = demo();
        // "’" is E2 80 99; the byte piece for byte b is id 7 + b.
        let ids = [7 + 0xE2, 7 + 0x80, 7 + 0x99];
        let mut stream = StreamDecoder::new(&tokenizer);
        let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
        assert_eq!(pieces, ["", "", ""], "a byte run is held until it ends");
        assert_eq!(stream.push(300), format!("’{}", tokenizer.decode(&[300])));
        assert_eq!(stream.finish(), "");
    }
}
