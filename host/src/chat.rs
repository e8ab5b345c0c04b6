//! Chat prompts through the checkpoint's own template: `chat_template` in
//! `tokenizer_config.json` (a string, or Hugging Face's list of named templates), else
//! `chat_template.jinja`, else Gemma's turn format. Rendered with minijinja, which implements
//! the Jinja2 subset Hugging Face templates use.

use std::path::{Path, PathBuf};

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

/// Gemma's turn format, for checkpoints that ship no template.
const GEMMA_TURNS: &str = "{{ bos_token }}{% for message in messages %}\
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}\
{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{file}: {reason}")]
    Load { file: PathBuf, reason: String },
    #[error("the chat template ({source_name}) does not compile: {reason}")]
    Compile { source_name: String, reason: String },
    #[error("the chat template ({source_name}) refused the messages: {reason}")]
    Render { source_name: String, reason: String },
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for errors.
    source_name: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// The template of the checkpoint in `model_dir`.
    pub fn load(model_dir: &Path) -> Result<ChatTemplate, ChatError> {
        let config_file = model_dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_file) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| ChatError::Load { file: config_file.clone(), reason: format!("not valid JSON: {e}") })?,
            Err(_) => serde_json::Value::Null,
        };
        let refuse = |key: &str, found: &serde_json::Value| ChatError::Load {
            file: config_file.clone(),
            reason: format!(
                "{key}: expected {}, found {found}",
                match key {
                    "chat_template" => "a template string or a list of named templates",
                    _ => "a token string or an object with its `content`",
                }
            ),
        };
        let token = |key: &str, default: &str| match config.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default.to_owned()),
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(v @ serde_json::Value::Object(o)) => {
                o.get("content").and_then(|c| c.as_str()).map(str::to_owned).ok_or_else(|| refuse(key, v))
            }
            Some(v) => Err(refuse(key, v)),
        };
        let (bos_token, eos_token) = (token("bos_token", "<bos>")?, token("eos_token", "<eos>")?);
        let jinja_file = model_dir.join("chat_template.jinja");
        let (source, source_name) = match config.get("chat_template") {
            Some(serde_json::Value::String(t)) => (t.clone(), "chat_template in tokenizer_config.json".to_owned()),
            Some(serde_json::Value::Array(named)) => {
                let default = named.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                let template = default.and_then(|t| t.get("template")).and_then(|t| t.as_str()).ok_or_else(|| {
                    ChatError::Load {
                        file: config_file.clone(),
                        reason: "chat_template is a list without a template named \"default\"".into(),
                    }
                })?;
                (template.to_owned(), "chat_template \"default\" in tokenizer_config.json".to_owned())
            }
            Some(v) if !v.is_null() => return Err(refuse("chat_template", v)),
            _ if jinja_file.exists() => {
                let text = std::fs::read_to_string(&jinja_file)
                    .map_err(|e| ChatError::Load { file: jinja_file.clone(), reason: e.to_string() })?;
                (text, "chat_template.jinja".to_owned())
            }
            _ => (GEMMA_TURNS.to_owned(), "Gemma's turn format (the checkpoint ships no template)".to_owned()),
        };
        ChatTemplate::new(source, source_name, bos_token, eos_token)
    }

    fn new(source: String, source_name: String, bos_token: String, eos_token: String) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.add_function("raise_exception", |message: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned("chat", source)
            .map_err(|e| ChatError::Compile { source_name: source_name.clone(), reason: e.to_string() })?;
        Ok(ChatTemplate { env, source_name, bos_token, eos_token })
    }

    /// The prompt for `messages`, ending where the assistant's answer begins. Special tokens
    /// are part of the text: encode it without adding the tokenizer's own.
    pub fn render(&self, messages: &[Message]) -> Result<String, ChatError> {
        let template = self.env.get_template("chat").expect("added in new");
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| ChatError::Render { source_name: self.source_name.clone(), reason: e.to_string() })
    }

    /// Where the template came from.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma() -> ChatTemplate {
        ChatTemplate::new(GEMMA_TURNS.into(), "test".into(), "<bos>".into(), "<eos>".into()).unwrap()
    }

    fn user(text: &str) -> Message {
        Message { role: "user".into(), content: text.into() }
    }

    #[test]
    fn gemma_turns_render_as_gemma_writes_them() {
        let messages = [user("Hi "), Message { role: "assistant".into(), content: "Hello".into() }, user("Who?")];
        assert_eq!(
            gemma().render(&messages).unwrap(),
            "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n\
             <start_of_turn>user\nWho?<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn a_template_that_raises_is_an_error_naming_its_message() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}".into(),
            "test".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let system = Message { role: "system".into(), content: "x".into() };
        let e = t.render(&[system]).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        assert!(t.render(&[user("x")]).is_ok());
    }

    #[test]
    fn a_template_that_does_not_compile_is_refused_at_load() {
        let e = ChatTemplate::new("{% for %}".into(), "x.jinja".into(), String::new(), String::new())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("x.jinja"), "{e}");
    }

    #[test]
    fn tokenizer_config_values_of_the_wrong_type_are_refused_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        for (config, says) in [
            (
                r#"{"chat_template": 5}"#,
                "chat_template: expected a template string or a list of named templates, found 5",
            ),
            (r#"{"eos_token": ["<eos>"]}"#, "eos_token: expected a token string or an object with its `content`"),
            (r#"{"bos_token": {"text": "<bos>"}}"#, "bos_token: expected a token string"),
        ] {
            std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
            let e = ChatTemplate::load(dir.path()).err().unwrap().to_string();
            assert!(e.contains("tokenizer_config.json") && e.contains(says), "{config}: {e}");
        }
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"chat_template": null}"#).unwrap();
        assert!(ChatTemplate::load(dir.path()).is_ok());
    }

    #[test]
    fn the_demo_target_ships_its_template() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/kjv-gemma4");
        let t = ChatTemplate::load(&dir).unwrap();
        assert_eq!(t.source_name(), "chat_template in tokenizer_config.json");
        assert_eq!(t.render(&[user("Hi")]).unwrap(), gemma().render(&[user("Hi")]).unwrap());
    }
}
