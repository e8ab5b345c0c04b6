//! Text ↔ token ids through a checkpoint's `tokenizer.json`, and the Gemma chat format.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{file}: {reason}")]
    Load { file: PathBuf, reason: String },
    #[error("tokenizing the prompt: {0}")]
    Encode(String),
    #[error("prompt token id {id} is outside the vocabulary of {vocab}")]
    OutOfVocabulary { id: u32, vocab: u32 },
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn load(model_dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let file = model_dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| TokenizerError::Load { file, reason: e.to_string() })?;
        Ok(Tokenizer { inner })
    }

    /// Ids of `text`, with the tokenizer's own special tokens (e.g. `<bos>`) when it adds them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode(text, true).map_err(|e| TokenizerError::Encode(e.to_string()))?;
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

    /// A single user turn in the Gemma chat format, ready for the model to answer.
    pub fn chat_prompt(&self, user: &str) -> String {
        let bos = if self.inner.get_post_processor().is_some() { "" } else { "<bos>" };
        format!("{bos}<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n")
    }
}

/// Appends generated ids and yields the text they add, holding back bytes that do not yet
/// form whole characters.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        StreamDecoder { tokenizer, ids: Vec::new(), printed: 0 }
    }

    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids);
        if text.ends_with('\u{FFFD}') || text.len() < self.printed || !text.is_char_boundary(self.printed) {
            return String::new();
        }
        let new = text[self.printed..].to_owned();
        self.printed = text.len();
        new
    }

    pub fn text(&self) -> String {
        self.tokenizer.decode(&self.ids)
    }
}
