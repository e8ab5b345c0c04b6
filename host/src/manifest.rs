//! Manifests: which target, which drafter, how to generate. TOML; paths are relative to the
//! manifest file; unknown keys, wrong types and missing files are errors naming file, line
//! and key.
//!
//! ```toml
//! [target]
//! model = "../models/gemma4-tiny"     # a Hugging Face-format directory
//!
//! [drafter]                           # absent: plain decoding
//! kind = "ngram"                      # a plugin kind found in the plugins directory
//! plugins_dir = "../plugins"          # optional: where to look for it (--plugins-dir wins)
//! artifact = "../models/some-drafter" # the drafter's checkpoint, for kinds that need one
//! sha256 = "…"                        # optional pin of the plugin library
//! draft_tokens = 4                   # or "auto": fewer as more requests share a round
//! verify = "match"                    # or "rejection" (drafters that return probabilities)
//! tree_nodes = 16                     # optional: a tree of up to 16 drafts per row, where the
//!                                     # drafter offers trees (docs/plugins.md)
//!
//! [drafter.options]                   # the plugin's own options (`host plugins inspect KIND`)
//! max_ngram = 3
//!
//! [generation]
//! prompt = "In the beginning"
//! max_tokens = 128
//! temperature = 0.0
//! seed = 0
//! ```

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use plugin_api::Descriptor;

use crate::speculative::Verify;

/// The most draft tokens per round a manifest or the command line may ask for: far beyond what
/// pays (a verify window costs more with every position), and bounded so that no request can
/// make the host allocate for millions of positions.
pub const MAX_DRAFT_TOKENS: u32 = 64;

/// The most nodes a row's tree of drafts may hold: each is a row of the verify forward.
pub const MAX_TREE_NODES: u32 = 64;

/// A manifest error: the file, the line when known, and one line of what is wrong.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ManifestError {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    target: TargetSection,
    drafter: Option<DrafterSection>,
    #[serde(default)]
    generation: Generation,
    #[serde(default)]
    server: Server,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetSection {
    model: Spanned<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DrafterSection {
    kind: String,
    /// Where its plugin is looked for, relative to the manifest (see `plugins_dir`).
    plugins_dir: Option<Spanned<PathBuf>>,
    artifact: Option<Spanned<PathBuf>>,
    sha256: Option<Spanned<String>>,
    /// A count or "auto", checked in [`Manifest::parse`] so that a wrong value names its line.
    draft_tokens: Option<Spanned<toml::Value>>,
    #[serde(default = "default_verify")]
    verify: Verify,
    tree_nodes: Option<Spanned<u32>>,
    options: Option<Spanned<toml::Table>>,
}

fn default_verify() -> Verify {
    Verify::Match
}

const DEFAULT_DRAFT_TOKENS: u32 = 4;

/// Tokens the drafter proposes per round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftTokens {
    Fixed(u32),
    /// Each round as many as pay, from the rows' acceptance and the measured costs, up to
    /// [`crate::speculative::AUTO_MOST`].
    Auto,
}

impl std::str::FromStr for DraftTokens {
    type Err = String;

    /// A length as the command line gives it: `"auto"` or 1 to [`MAX_DRAFT_TOKENS`].
    fn from_str(s: &str) -> Result<DraftTokens, String> {
        match (s, s.parse::<u32>()) {
            ("auto", _) => Ok(DraftTokens::Auto),
            (_, Ok(n)) if (1..=MAX_DRAFT_TOKENS).contains(&n) => Ok(DraftTokens::Fixed(n)),
            _ => Err(format!("must be 1 to {MAX_DRAFT_TOKENS} or \"auto\", got `{s}`")),
        }
    }
}

impl std::fmt::Display for DraftTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftTokens::Fixed(n) => write!(f, "{n}"),
            DraftTokens::Auto => f.write_str("auto"),
        }
    }
}

/// How to generate; every field can be overridden on the command line. Sampling fields left
/// out fall back to the checkpoint's generation_config.json, then to greedy decoding.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Generation {
    pub prompt: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
    pub chat: bool,
    pub max_tokens: u32,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: u64,
    /// OpenAI's penalties over the generated tokens, −2 to 2.
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// mlx-lm's penalty over the last `repetition_context_size` tokens (20 if not given).
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: Option<usize>,
    /// Token id (a key) → bias added to its logit, −100 to 100.
    pub logit_bias: std::collections::BTreeMap<String, f32>,
    /// Report each token's log-probability with this many alternatives (`host run --json`).
    pub logprobs: Option<usize>,
}

impl Default for Generation {
    fn default() -> Self {
        Generation {
            prompt: None,
            prompt_ids: None,
            chat: false,
            max_tokens: 128,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            seed: 0,
            frequency_penalty: None,
            presence_penalty: None,
            repetition_penalty: None,
            repetition_context_size: None,
            logit_bias: Default::default(),
            logprobs: None,
        }
    }
}

/// `host serve`'s settings; each can be given on the command line instead, which wins.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub api_key: Option<String>,
    pub max_batch: Option<u32>,
    pub max_queue: Option<u32>,
    pub prefix_cache_mb: Option<u32>,
}

/// A checked manifest, paths resolved.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub file: PathBuf,
    pub target_model: PathBuf,
    pub drafter: Option<DrafterSpec>,
    pub generation: Generation,
    pub server: Server,
}

#[derive(Debug, Clone)]
pub struct DrafterSpec {
    pub kind: String,
    /// The directory the manifest names for its plugin, resolved against the manifest's own.
    pub plugins_dir: Option<PathBuf>,
    pub artifact: Option<PathBuf>,
    pub sha256: Option<String>,
    pub draft_tokens: DraftTokens,
    /// `match` (coupled draws, any drafter) or `rejection` (needs draft probabilities).
    pub verify: Verify,
    /// The most nodes of a row's tree of drafts; 0: chains.
    pub tree_nodes: usize,
    /// The plugin's options, as TOML text for the plugin.
    pub options: toml::Table,
    /// Line of each option key, for messages.
    pub option_lines: Vec<(String, usize)>,
}

/// Where a run's target and drafter come from: a manifest, flags (`--model`, `--drafter`,
/// `--drafter-artifact`), or both, the flags overriding the manifest.
#[derive(Debug, Clone, Default)]
pub struct Source {
    pub manifest: Option<PathBuf>,
    /// A directory or a Hugging Face model id.
    pub model: Option<String>,
    /// A drafter kind.
    pub drafter: Option<String>,
    pub drafter_artifact: Option<PathBuf>,
}

impl Source {
    pub fn manifest(file: &Path) -> Source {
        Source { manifest: Some(file.to_owned()), ..Source::default() }
    }

    pub fn load(&self) -> Result<Manifest, ManifestError> {
        let flags = Path::new("<command line>");
        let error = |message: String| ManifestError { file: flags.to_owned(), line: None, message };
        let mut manifest = match (&self.manifest, &self.model) {
            (Some(file), _) => Manifest::load(file)?,
            (None, Some(_)) => Manifest {
                file: flags.to_owned(),
                target_model: PathBuf::new(),
                drafter: None,
                generation: Generation::default(),
                server: Server::default(),
            },
            (None, None) => return Err(error("give --manifest or --model".into())),
        };
        if let Some(model) = &self.model {
            manifest.target_model =
                crate::hub::resolve(model, Path::new(".")).map_err(|e| error(format!("--model: {e}")))?;
        }
        if let Some(kind) = &self.drafter {
            manifest.drafter = Some(DrafterSpec {
                kind: kind.clone(),
                plugins_dir: None,
                artifact: None,
                sha256: None,
                draft_tokens: DraftTokens::Fixed(DEFAULT_DRAFT_TOKENS),
                verify: default_verify(),
                tree_nodes: 0,
                options: toml::Table::new(),
                option_lines: Vec::new(),
            });
        }
        if let Some(artifact) = &self.drafter_artifact {
            let drafter =
                manifest.drafter.as_mut().ok_or_else(|| error("--drafter-artifact needs a drafter".into()))?;
            if !artifact.is_dir() {
                return Err(error(format!("--drafter-artifact: {} is not a directory", artifact.display())));
            }
            drafter.artifact = Some(artifact.clone());
        }
        Ok(manifest)
    }
}

impl Manifest {
    pub fn load(file: &Path) -> Result<Manifest, ManifestError> {
        let text = std::fs::read_to_string(file).map_err(|e| ManifestError {
            file: file.to_owned(),
            line: None,
            message: format!("cannot read: {e}"),
        })?;
        Manifest::parse(file, &text)
    }

    pub fn parse(file: &Path, text: &str) -> Result<Manifest, ManifestError> {
        let at = |span: Option<Range<usize>>, message: String| ManifestError {
            file: file.to_owned(),
            line: span.map(|s| line_of(text, s.start)),
            message,
        };
        // toml's messages may run over lines; a refusal is one.
        let parsed: File = toml::from_str(text).map_err(|e| at(e.span(), e.message().trim().replace('\n', ": ")))?;
        let base = file.parent().unwrap_or(Path::new("."));
        let existing = |key: &str, path: &Spanned<PathBuf>, want_dir: bool| {
            let resolved = base.join(path.get_ref());
            let ok = if want_dir { resolved.is_dir() } else { resolved.exists() };
            if ok {
                Ok(resolved)
            } else {
                let what = if want_dir && resolved.exists() { "is not a directory" } else { "does not exist" };
                Err(at(Some(path.span()), format!("{key}: {} {what}", resolved.display())))
            }
        };

        // For checks made after parsing: the line `key` is written on.
        let at_key = |key: &str, message: String| ManifestError {
            file: file.to_owned(),
            line: Some(key_line(text, 0..text.len(), key)),
            message,
        };

        let model = &parsed.target.model;
        if model.get_ref().as_os_str().is_empty() {
            return Err(at(
                Some(model.span()),
                "target.model: empty; name a Gemma 4 checkpoint directory or a Hugging Face id".into(),
            ));
        }
        let target_model = crate::hub::resolve(&model.get_ref().to_string_lossy(), base)
            .map_err(|e| at(Some(model.span()), format!("target.model: {e}")))?;
        if !target_model.join("config.json").is_file() {
            return Err(at(
                Some(model.span()),
                format!(
                    "target.model: {} has no config.json: it is not a checkpoint directory",
                    target_model.display()
                ),
            ));
        }
        let drafter = match parsed.drafter {
            None => None,
            Some(d) => {
                if d.kind.is_empty() || !d.kind.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                    return Err(at_key(
                        "kind",
                        format!(
                            "drafter.kind: `{}` is not a plugin kind (letters, digits, `_` and `-`; `host plugins list` names those loaded)",
                            d.kind
                        ),
                    ));
                }
                let artifact = d.artifact.as_ref().map(|a| existing("drafter.artifact", a, true)).transpose()?;
                let plugins_dir =
                    d.plugins_dir.as_ref().map(|p| existing("drafter.plugins_dir", p, true)).transpose()?;
                let sha256 = d
                    .sha256
                    .map(|pin| {
                        let hex = pin.get_ref().trim().to_lowercase();
                        if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                            Ok(hex)
                        } else {
                            Err(at(Some(pin.span()), "drafter.sha256: expected 64 hexadecimal digits".into()))
                        }
                    })
                    .transpose()?;
                let draft_tokens = match d.draft_tokens {
                    None => DraftTokens::Fixed(DEFAULT_DRAFT_TOKENS),
                    Some(value) => {
                        let span = value.span();
                        match value.into_inner() {
                            toml::Value::Integer(n) if (1..=MAX_DRAFT_TOKENS as i64).contains(&n) => {
                                DraftTokens::Fixed(n as u32)
                            }
                            toml::Value::String(w) if w == "auto" => DraftTokens::Auto,
                            other => {
                                return Err(at(
                                    Some(span),
                                    format!(
                                    "drafter.draft_tokens: must be 1 to {MAX_DRAFT_TOKENS} or \"auto\", got {other}"
                                ),
                                ))
                            }
                        }
                    }
                };
                let tree_nodes = match d.tree_nodes {
                    None => 0,
                    Some(n) if (1..=MAX_TREE_NODES).contains(n.get_ref()) => *n.get_ref() as usize,
                    Some(n) => {
                        let message = format!("drafter.tree_nodes: must be 1 to {MAX_TREE_NODES}, got {}", n.get_ref());
                        return Err(at(Some(n.span()), message));
                    }
                };
                let (options, option_lines) = match d.options {
                    None => (toml::Table::new(), Vec::new()),
                    Some(spanned) => {
                        let span = spanned.span();
                        let table = spanned.into_inner();
                        let lines = table.keys().map(|k| (k.clone(), key_line(text, span.clone(), k))).collect();
                        (table, lines)
                    }
                };
                Some(DrafterSpec {
                    kind: d.kind,
                    plugins_dir,
                    artifact,
                    sha256,
                    draft_tokens,
                    verify: d.verify,
                    tree_nodes,
                    options,
                    option_lines,
                })
            }
        };
        let g = &parsed.generation;
        if g.prompt.is_some() && g.prompt_ids.is_some() {
            return Err(at_key("prompt_ids", "generation: give `prompt` or `prompt_ids`, not both".into()));
        }
        use crate::sampling::{check_min_p, check_temperature, check_top_p};
        let bounds = [
            ("temperature", g.temperature.map(check_temperature)),
            ("top_p", g.top_p.map(check_top_p)),
            ("min_p", g.min_p.map(check_min_p)),
        ];
        for (key, check) in bounds {
            if let Some(Err(e)) = check {
                return Err(at_key(key, format!("generation.{key}: {e}")));
            }
        }
        let bias = crate::sampling::Penalties::parse_logit_bias(&g.logit_bias)
            .map_err(|e| at_key("logit_bias", format!("generation.logit_bias: {e}")))?;
        let penalties = crate::sampling::Penalties {
            frequency_penalty: g.frequency_penalty.unwrap_or(0.0),
            presence_penalty: g.presence_penalty.unwrap_or(0.0),
            repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
            logit_bias: bias,
            ..Default::default()
        };
        // Token ids are checked against the vocabulary when the target is loaded.
        if let Err((key, e)) = penalties.validate(usize::MAX) {
            return Err(at_key(key, format!("generation.{key}: {e}")));
        }
        if g.chat && g.prompt_ids.is_some() {
            return Err(at_key(
                "chat",
                "generation.chat: a chat template wraps a text `prompt`, and `prompt_ids` are already tokens".into(),
            ));
        }
        let server = parsed.server;
        if let Some(n) = server.max_batch.filter(|n| !(1..=256).contains(n)) {
            return Err(at_key("max_batch", format!("server.max_batch: must be 1 to 256, got {n}")));
        }
        if server.max_queue == Some(0) {
            return Err(at_key("max_queue", "server.max_queue: must be at least 1, got 0".into()));
        }
        Ok(Manifest { file: file.to_owned(), target_model, drafter, generation: parsed.generation, server })
    }

    /// Checks the drafter section against the plugin's descriptor: known option keys, and an
    /// artifact when the plugin needs one.
    pub fn check_drafter(&self, descriptor: &Descriptor) -> Result<(), ManifestError> {
        let Some(drafter) = &self.drafter else { return Ok(()) };
        let error = |line, message| ManifestError { file: self.file.clone(), line, message };
        if drafter.verify == Verify::Rejection && !descriptor.capabilities.draft_probabilities {
            return Err(error(
                None,
                format!(
                    "drafter.verify: `rejection` needs draft probabilities, which drafter `{}` does not return",
                    drafter.kind
                ),
            ));
        }
        crate::plugin::check_artifact(descriptor, drafter.artifact.as_deref())
            .map_err(|why| error(None, format!("drafter.artifact: {why}")))?;
        let known: Vec<&str> = descriptor.options.iter().map(|o| o.key.as_str()).collect();
        for (key, line) in &drafter.option_lines {
            if !known.contains(&key.as_str()) {
                let known = if known.is_empty() { "none".to_owned() } else { known.join(", ") };
                return Err(error(
                    Some(*line),
                    format!("drafter.options.{key}: unknown option for drafter `{}` (known: {known})", drafter.kind),
                ));
            }
        }
        Ok(())
    }
}

impl DrafterSpec {
    /// The options as TOML text, the form in which they cross to the plugin.
    pub fn options_toml(&self) -> String {
        toml::to_string(&self.options).unwrap_or_default()
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The line where `key` is written inside the table spanning `span`.
fn key_line(text: &str, span: Range<usize>, key: &str) -> usize {
    let start = span.start.min(text.len());
    let region = &text[start..span.end.min(text.len())];
    let mut offset = start;
    for line in region.split_inclusive('\n') {
        let trimmed = line.trim_start().trim_start_matches(['"', '\'']);
        if trimmed.starts_with(key)
            && trimmed[key.len()..].trim_start_matches(['"', '\'']).trim_start().starts_with('=')
        {
            return line_of(text, offset);
        }
        offset += line.len();
    }
    line_of(text, start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest_in(dir: &Path, text: &str) -> Result<Manifest, ManifestError> {
        std::fs::create_dir_all(dir.join("model")).unwrap();
        std::fs::write(dir.join("model/config.json"), "{}").unwrap();
        let file = dir.join("m.toml");
        std::fs::write(&file, text).unwrap();
        Manifest::load(&file)
    }

    /// A fresh directory for one test, removed with it.
    fn temp(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("host-manifest-{name}-")).tempdir().unwrap()
    }

    #[test]
    fn an_empty_model_or_a_directory_without_a_config_is_refused_at_its_line() {
        let dir = temp("model");
        let error = manifest_in(dir.path(), "# a target\n[target]\nmodel = \"\"\n").unwrap_err().to_string();
        assert!(
            error.ends_with("m.toml:3: target.model: empty; name a Gemma 4 checkpoint directory or a Hugging Face id"),
            "{error}"
        );
        std::fs::create_dir_all(dir.path().join("empty")).unwrap();
        let error = manifest_in(dir.path(), "[target]\nmodel = \"empty\"\n").unwrap_err().to_string();
        assert!(
            error.contains("m.toml:2: target.model: ")
                && error.ends_with("has no config.json: it is not a checkpoint directory"),
            "{error}"
        );
    }

    #[test]
    fn chat_with_prompt_ids_and_bad_server_values_name_their_line() {
        let dir = temp("lines");
        let text = "[target]\nmodel = \"model\"\n[generation]\nprompt_ids = [2, 3]\nchat = true\n";
        let error = manifest_in(dir.path(), text).unwrap_err().to_string();
        assert!(error.contains("m.toml:5: generation.chat: a chat template wraps a text `prompt`"), "{error}");
        let text = "[target]\nmodel = \"model\"\n[generation]\nmax_tokens = 3\ntop_p = 0.0\n";
        let error = manifest_in(dir.path(), text).unwrap_err().to_string();
        assert!(error.contains("m.toml:5: generation.top_p: top_p must be in (0, 1]"), "{error}");
        let text = "[target]\nmodel = \"model\"\n[generation]\nmax_tokens = 3\npresence_penalty = 2.5\n";
        let error = manifest_in(dir.path(), text).unwrap_err().to_string();
        assert!(error.contains("m.toml:5: generation.presence_penalty: must be from -2 to 2, got 2.5"), "{error}");
        let text = "[target]\nmodel = \"model\"\n[generation]\nmax_tokens = 3\nlogit_bias = { x = 1.0 }\n";
        let error = manifest_in(dir.path(), text).unwrap_err().to_string();
        assert!(error.contains("m.toml:5: generation.logit_bias: `x` is not a token id"), "{error}");
        let text = "[target]\nmodel = \"model\"\n[generation]\nrepetition_penalty = 1.1\nlogit_bias = { 7 = -100 }\n";
        let g = manifest_in(dir.path(), text).unwrap().generation;
        assert_eq!((g.repetition_penalty, g.logit_bias.get("7")), (Some(1.1), Some(&-100.0)));
        let text = "[target]\nmodel = \"model\"\n[server]\nport = 1\nmax_batch = 0\n";
        let error = manifest_in(dir.path(), text).unwrap_err().to_string();
        assert!(error.contains("m.toml:5: server.max_batch: must be 1 to 256, got 0"), "{error}");
    }

    #[test]
    fn paths_resolve_relative_to_the_manifest() {
        let dir = temp("relative");
        let m = manifest_in(
            dir.path(),
            "[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\n[drafter.options]\nmax_ngram = 4\n",
        )
        .unwrap();
        assert_eq!(m.target_model, dir.path().join("model"));
        let d = m.drafter.unwrap();
        assert_eq!((d.kind.as_str(), d.draft_tokens), ("ngram", DraftTokens::Fixed(4)));
        assert_eq!(d.options["max_ngram"].as_integer(), Some(4));
        assert_eq!(m.generation, Generation::default());
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let dir = temp("unknown");
        let e = manifest_in(dir.path(), "[target]\nmodel = \"model\"\n\n[generation]\nmax_tokenz = 3\n").unwrap_err();
        assert_eq!(e.line, Some(5));
        assert!(e.to_string().contains("m.toml:5:"), "{e}");
        assert!(e.message.contains("unknown field `max_tokenz`"), "{e}");
    }

    #[test]
    fn wrong_type_names_the_line() {
        let dir = temp("type");
        let e =
            manifest_in(dir.path(), "[target]\nmodel = \"model\"\n[generation]\ntemperature = \"hot\"\n").unwrap_err();
        assert_eq!(e.line, Some(4));
        assert!(e.message.contains("invalid type"), "{e}");
    }

    #[test]
    fn missing_file_names_key_and_resolved_path() {
        let dir = temp("missing");
        let e = manifest_in(dir.path(), "[target]\nmodel = \"model\"\n[drafter]\nkind = \"x\"\nartifact = \"nope\"\n")
            .unwrap_err();
        assert_eq!(e.line, Some(5));
        assert!(e.message.starts_with("drafter.artifact: "), "{e}");
        assert!(e.message.contains("nope does not exist"), "{e}");
    }

    #[test]
    fn missing_section_is_an_error() {
        let dir = temp("section");
        let e = manifest_in(dir.path(), "[generation]\nseed = 1\n").unwrap_err();
        assert!(e.message.contains("missing field `target`"), "{e}");
    }

    #[test]
    fn unknown_drafter_option_is_refused_against_the_descriptor() {
        let dir = temp("option");
        let m = manifest_in(dir.path(), "[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\n[drafter.options]\nmax_ngram = 3\nmax_gram = 2\n")
            .unwrap();
        let descriptor = Descriptor::new("ngram", "n", "0").option("max_ngram", "3", "");
        let e = m.check_drafter(&descriptor).unwrap_err();
        assert_eq!(e.line, Some(7));
        assert!(e.message.contains("drafter.options.max_gram: unknown option"), "{e}");
    }

    #[test]
    fn tree_nodes_is_a_count_and_chains_without_it() {
        let dir = temp("tree-nodes");
        let with = |line: &str| {
            manifest_in(dir.path(), &format!("[target]\nmodel = \"model\"\n[drafter]\nkind = \"x\"\n{line}\n"))
        };
        assert_eq!(with("").unwrap().drafter.unwrap().tree_nodes, 0);
        assert_eq!(with("tree_nodes = 16").unwrap().drafter.unwrap().tree_nodes, 16);
        for bad in ["0", "65"] {
            let e = with(&format!("tree_nodes = {bad}")).unwrap_err();
            assert_eq!(e.line, Some(5), "{bad}");
            assert!(e.message.contains(&format!("drafter.tree_nodes: must be 1 to 64, got {bad}")), "{e}");
        }
    }

    #[test]
    fn draft_tokens_is_a_count_or_auto() {
        let dir = temp("draft-tokens");
        let with = |value: &str| {
            manifest_in(
                dir.path(),
                &format!("[target]\nmodel = \"model\"\n[drafter]\nkind = \"x\"\ndraft_tokens = {value}\n"),
            )
        };
        assert_eq!(with("\"auto\"").unwrap().drafter.unwrap().draft_tokens, DraftTokens::Auto);
        assert_eq!(with("7").unwrap().drafter.unwrap().draft_tokens, DraftTokens::Fixed(7));
        for bad in ["0", "65", "\"fast\"", "2.5"] {
            let e = with(bad).unwrap_err();
            assert_eq!(e.line, Some(5), "{bad}");
            assert!(e.message.contains("drafter.draft_tokens: must be 1 to 64 or \"auto\", got"), "{e}");
        }
    }

    #[test]
    fn bad_pin_is_refused() {
        let dir = temp("pin");
        let e = manifest_in(dir.path(), "[target]\nmodel = \"model\"\n[drafter]\nkind = \"x\"\nsha256 = \"abc\"\n")
            .unwrap_err();
        assert_eq!(e.line, Some(5));
    }
}
