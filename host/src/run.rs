//! `host run`: resolving one request from the command line, the manifest and the checkpoint's
//! own defaults (in that order of precedence), then generating it.

use std::path::Path;
use std::rc::Rc;

use serde::Serialize;

use crate::chat::{ChatTemplate, Message};
use crate::generate::{generate, Event, Flow, GenerateError, Request, Stats, StopReason};
use crate::manifest::{DraftTokens, Manifest, ManifestError};
use crate::model::{Gemma4, ModelError};
use crate::plugin::{DrafterError, LoadedDrafter, SelectError};
use crate::plugins_dir::PluginsDir;
use crate::sampling::{Penalties, SamplingParams, TokenLogprob};
use crate::speculative::{generate_speculative, probe_open, SpecConfig, Verify, AUTO_MOST};
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// What `host run` is asked: a manifest, the command line's overrides, where plugins live.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub source: crate::manifest::Source,
    pub overrides: Overrides,
    pub plugins_dir: PluginsDir,
    /// After a speculative run, decode the same request plainly and report both.
    pub compare_plain: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    DrafterSetup(#[from] DrafterSetupError),
    #[error(transparent)]
    Drafter(#[from] DrafterError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{0}")]
    CheckpointDefaults(String),
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// Generation failed partway (e.g. NaN logits at a later step): what was produced is kept
    /// for the caller to print.
    #[error("{}", .0.error)]
    Partway(Box<Partway>),
    #[error("--draft-tokens: must be 1 to {max}, got {0}", max = crate::manifest::MAX_DRAFT_TOKENS)]
    DraftTokens(u32),
    #[error("--draft-tokens: no drafter is set (name one with --drafter KIND or a manifest's [drafter])")]
    DraftTokensWithoutDrafter,
}

/// What `run` reports while it works.
pub enum RunEvent<'a> {
    /// `done` of the prompt's `total` tokens are through the target.
    Prefill { done: usize, total: usize },
    /// Generated text, as soon as it is whole.
    Text(&'a str),
    /// Something the user should know before the text, e.g. a draft length beyond the
    /// drafter's own limit.
    Warning(String),
}

/// What a generation that failed partway produced before it failed.
#[derive(Debug)]
pub struct Partway {
    pub error: GenerateError,
    pub tokens: Vec<u32>,
    pub text: String,
}

/// Generates the request `options` describe, reporting warnings, the prefill's progress and each
/// piece of text to `on_event`, which may answer [`Flow::Stop`]. The returned text is exactly the
/// concatenation of the pieces.
pub fn run(options: &RunOptions, mut on_event: impl FnMut(RunEvent) -> Flow) -> Result<RunOutput, RunError> {
    let session = Session::open(options, |warning| {
        on_event(RunEvent::Warning(warning));
    })?;
    let request = session.request(&options.overrides)?;
    let mut stream = StreamDecoder::new(&session.tokenizer);
    let mut produced = Vec::new();
    let on_generate = |event| match event {
        Event::Prefill { done, total } => on_event(RunEvent::Prefill { done, total }),
        Event::Token(token) => {
            produced.push(token);
            let piece = stream.push(token);
            if piece.is_empty() {
                Flow::Continue
            } else {
                on_event(RunEvent::Text(&piece))
            }
        }
        Event::Logprob(_) => Flow::Continue,
    };
    let generation = match session.speculation() {
        None => generate(&session.model, &request, on_generate),
        Some((drafter, config)) => generate_speculative(&session.model, drafter, &request, config, on_generate),
    };
    let generation = generation.map_err(|error| {
        let text = session.tokenizer.decode(&produced);
        RunError::Partway(Box::new(Partway { error, text, tokens: std::mem::take(&mut produced) }))
    })?;
    let rest = stream.finish();
    if !rest.is_empty() {
        on_event(RunEvent::Text(&rest));
    }
    let plain = match (&session.drafter, options.compare_plain) {
        (Some((_, config)), true) => {
            let plain = generate(&session.model, &request, |_| Flow::Continue)?;
            Some(PlainComparison {
                decode_ms: plain.stats.decode_ms,
                speedup: plain.stats.decode_ms / generation.stats.decode_ms,
                identical: plain.tokens == generation.tokens,
                first_difference: first_difference(&plain.tokens, &generation.tokens),
                rejection: config.verify == Verify::Rejection && !request.sampling.is_greedy(),
            })
        }
        _ => None,
    };
    Ok(RunOutput {
        text: stream.text(),
        tokens: generation.tokens,
        stop: generation.stop,
        stats: generation.stats,
        logprobs: generation.logprobs,
        plain,
    })
}

/// The same request decoded plainly after a speculative run (`host run --compare-plain`).
#[derive(Debug, Serialize)]
pub struct PlainComparison {
    pub decode_ms: f64,
    /// Plain decode time over speculative decode time.
    pub speedup: f64,
    pub identical: bool,
    /// The first generated position at which the two outputs differ; none when identical.
    pub first_difference: Option<usize>,
    /// Verified by rejection sampling, which keeps the target's distribution but not its draws.
    pub rejection: bool,
}

/// The first position at which `a` and `b` differ, a shorter one ending first included.
pub(crate) fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    (a != b).then(|| a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len())))
}

/// What a run loads once: the target, its drafter, tokenizer and generation defaults.
pub struct Session {
    pub manifest: Manifest,
    pub model: Rc<Gemma4>,
    /// The drafter and how it drafts (`config.auto`: `draft_tokens = "auto"` and no
    /// `--draft-tokens`).
    pub drafter: Option<(LoadedDrafter, SpecConfig)>,
    pub tokenizer: Tokenizer,
    pub defaults: CheckpointDefaults,
}

impl Session {
    /// Loads what `options` name, telling `warn` what the user should know first.
    pub fn open(options: &RunOptions, mut warn: impl FnMut(String)) -> Result<Session, RunError> {
        let manifest = options.source.load()?;
        let model = Rc::new(crate::model::load(&manifest.target_model)?);
        let mut drafter = load_drafter(&manifest, &options.plugins_dir)?;
        if drafter.is_none() && options.overrides.draft_tokens.is_some() {
            return Err(RunError::DraftTokensWithoutDrafter);
        }
        if let Some((d, config)) = &mut drafter {
            probe_open(&model, d)?;
            match options.overrides.draft_tokens {
                Some(n) if n == 0 || n > crate::manifest::MAX_DRAFT_TOKENS => return Err(RunError::DraftTokens(n)),
                Some(n) => {
                    *config = SpecConfig { tree_nodes: config.tree_nodes, ..SpecConfig::new(n as usize, config.verify) }
                }
                None => {}
            }
            depth_warnings(&d.info, config).into_iter().for_each(&mut warn);
        }
        let tokenizer = Tokenizer::load(&manifest.target_model)?;
        tokenizer.check_fits(model.config.vocab_size as usize, &model.config.special_ids())?;
        let defaults = CheckpointDefaults::load(&manifest.target_model).map_err(RunError::CheckpointDefaults)?;
        Ok(Session { manifest, model, drafter, tokenizer, defaults })
    }

    /// The drafter and its config, when the manifest names one.
    pub fn speculation(&self) -> Option<(&LoadedDrafter, SpecConfig)> {
        self.drafter.as_ref().map(|(drafter, config)| (drafter, *config))
    }

    /// The request the manifest, the checkpoint's defaults and `overrides` describe.
    pub fn request(&self, overrides: &Overrides) -> Result<Request, RequestError> {
        resolve_request(&self.manifest, overrides, &self.model, &self.tokenizer, &self.defaults)
    }
}

/// Values given on the command line; each overrides the manifest's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub prompt: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
    pub chat: bool,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub draft_tokens: Option<u32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: Option<usize>,
    pub logit_bias: Option<Vec<(u32, f32)>>,
    /// Report each token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
}

/// Sampling defaults and end-of-sequence ids from the checkpoint's generation_config.json.
#[derive(Debug, Clone, Default)]
pub struct CheckpointDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub eos: Vec<u32>,
}

impl CheckpointDefaults {
    /// Reads `generation_config.json` if the checkpoint has one. A value of the wrong type or
    /// out of its bounds is refused, naming the file, its line and the key: a default that is
    /// silently dropped would change the output without a word.
    pub fn load(model_dir: &Path) -> Result<CheckpointDefaults, String> {
        let file = model_dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&file) else { return Ok(Self::default()) };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not valid JSON: {e}", file.display()))?;
        let refuse = |key: &str, why: String| {
            let line = crate::model::config::json_key_line(&text, key).unwrap_or(1);
            format!("{}:{line}: {key}: {why}", file.display())
        };
        let number = |key: &str| -> Result<Option<f64>, String> {
            match json.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| refuse(key, format!("expected a number, got {v}"))),
            }
        };
        let bounded = |key: &str, check: fn(f32) -> Result<(), String>| -> Result<Option<f32>, String> {
            let value = number(key)?.map(|v| v as f32);
            value.map(check).transpose().map_err(|e| refuse(key, e))?;
            Ok(value)
        };
        let sampling = match json.get("do_sample") {
            None | Some(serde_json::Value::Null) => true,
            Some(v) => v.as_bool().ok_or_else(|| refuse("do_sample", format!("expected true or false, got {v}")))?,
        };
        let temperature = bounded("temperature", crate::sampling::check_temperature)?;
        let top_p = bounded("top_p", crate::sampling::check_top_p)?;
        let top_k = match number("top_k")? {
            None => None,
            Some(k) if k >= 0.0 && k.fract() == 0.0 && k <= u32::MAX as f64 => Some(k as u32),
            Some(k) => return Err(refuse("top_k", format!("expected a whole number >= 0 (0 = off), got {k}"))),
        };
        let ids = |v: &serde_json::Value| v.as_u64().filter(|&n| n <= u32::MAX as u64).map(|n| n as u32);
        let eos = match json.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Some(Vec::new()),
            Some(serde_json::Value::Array(a)) => a.iter().map(ids).collect::<Option<Vec<u32>>>(),
            Some(v) => ids(v).map(|id| vec![id]),
        }
        .ok_or_else(|| refuse("eos_token_id", "expected a token id or a list of them".into()))?;
        Ok(CheckpointDefaults { temperature: if sampling { temperature } else { Some(0.0) }, top_p, top_k, eos })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("no prompt: give --prompt or --prompt-ids, or set [generation] prompt in the manifest")]
    NoPrompt,
    #[error("chat: a chat template wraps a text prompt, and {0} are already tokens; give a text prompt")]
    ChatWithIds(&'static str),
    #[error("{0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
}

/// The request `host run` generates.
pub fn resolve_request(
    manifest: &Manifest,
    overrides: &Overrides,
    model: &Gemma4,
    tokenizer: &Tokenizer,
    defaults: &CheckpointDefaults,
) -> Result<Request, RequestError> {
    let g = &manifest.generation;
    let chat = overrides.chat || g.chat;
    let ids_given = match (&overrides.prompt_ids, &overrides.prompt, &g.prompt_ids) {
        (Some(_), _, _) => Some("the request's prompt_ids"),
        (None, None, Some(_)) => Some("the manifest's [generation] prompt_ids"),
        _ => None,
    };
    if let (true, Some(source)) = (chat, ids_given) {
        return Err(RequestError::ChatWithIds(source));
    }
    let template = if chat { Some(ChatTemplate::load(&manifest.target_model)?) } else { None };
    let encode = |text: &str| -> Result<Vec<u32>, RequestError> {
        match &template {
            None => Ok(tokenizer.encode(text)?),
            Some(t) => {
                Ok(tokenizer.encode_rendered(&t.render(&[Message { role: "user".into(), content: text.into() }])?)?)
            }
        }
    };
    let prompt = match (&overrides.prompt_ids, &overrides.prompt, &g.prompt_ids, &g.prompt) {
        (Some(ids), _, _, _) => ids.clone(),
        (None, Some(text), _, _) => encode(text)?,
        (None, None, Some(ids), _) => ids.clone(),
        (None, None, None, Some(text)) => encode(text)?,
        (None, None, None, None) => return Err(RequestError::NoPrompt),
    };
    let sampling = SamplingParams {
        temperature: overrides.temperature.or(g.temperature).or(defaults.temperature).unwrap_or(0.0),
        top_p: overrides.top_p.or(g.top_p).or(defaults.top_p).unwrap_or(1.0),
        top_k: overrides.top_k.or(g.top_k).or(defaults.top_k).unwrap_or(0),
        min_p: overrides.min_p.or(g.min_p).unwrap_or(0.0),
        seed: overrides.seed.unwrap_or(g.seed),
    };
    let penalties = Penalties {
        frequency_penalty: overrides.frequency_penalty.or(g.frequency_penalty).unwrap_or(0.0),
        presence_penalty: overrides.presence_penalty.or(g.presence_penalty).unwrap_or(0.0),
        repetition_penalty: overrides.repetition_penalty.or(g.repetition_penalty).unwrap_or(1.0),
        repetition_context_size: overrides
            .repetition_context_size
            .or(g.repetition_context_size)
            .unwrap_or(crate::sampling::REPETITION_CONTEXT),
        logit_bias: match &overrides.logit_bias {
            Some(bias) => bias.clone(),
            None => Penalties::parse_logit_bias(&g.logit_bias).expect("checked when the manifest loaded"),
        },
    };
    let mut eos = model.config.eos_token_ids.clone();
    eos.extend(&defaults.eos);
    eos.extend(tokenizer.eos_ids());
    eos.sort_unstable();
    eos.dedup();
    let max_tokens = overrides.max_tokens.unwrap_or(g.max_tokens) as usize;
    let logprobs = overrides.logprobs.or(g.logprobs);
    Ok(Request { prompt, max_tokens, sampling, penalties, logprobs, eos })
}

#[derive(Debug, thiserror::Error)]
pub enum DrafterSetupError {
    #[error(transparent)]
    Select(#[from] crate::plugin::SelectError),
    #[error(transparent)]
    Manifest(#[from] crate::manifest::ManifestError),
    #[error(transparent)]
    Drafter(#[from] crate::plugin::DrafterError),
}

/// What a draft length beyond the artifact's own limits will do: proposals are cut to
/// `max_draft_tokens`, and drafts past `trained_depth` were never trained for.
pub fn depth_warnings(info: &plugin_api::ProviderInfo, config: &SpecConfig) -> Vec<String> {
    let mut warnings = Vec::new();
    if config.auto {
        // Capped at the drafter's maximum; rounds go as deep as they find drafts accepted.
        return warnings;
    }
    let draft_tokens = config.draft_tokens;
    let max = info.capabilities.max_draft_tokens as usize;
    if max > 0 && draft_tokens > max {
        warnings.push(format!(
            "draft_tokens = {draft_tokens} exceeds the drafter's max_draft_tokens of {max}; it proposes at most {max}"
        ));
    }
    let trained = info.trained_depth as usize;
    if trained > 0 && draft_tokens > trained && trained != max {
        warnings
            .push(format!("draft_tokens = {draft_tokens} exceeds the {trained} tokens the drafter was trained for"));
    }
    warnings
}

/// The manifest's drafter: its plugin found in `plugins_dir` (by pin or kind), the manifest
/// checked against its descriptor, its artifact loaded with the manifest's options.
pub fn load_drafter(
    manifest: &Manifest,
    plugins_dir: &PluginsDir,
) -> Result<Option<(LoadedDrafter, SpecConfig)>, DrafterSetupError> {
    let Some(spec) = &manifest.drafter else { return Ok(None) };
    let dir = plugins_dir.for_manifest(spec.plugins_dir.as_deref());
    let plugin = crate::plugin::select(&dir.path, &spec.kind, spec.sha256.as_deref()).map_err(|e| match e {
        SelectError::NoSuchKind { kind, dir: path, loaded, refused, .. } => {
            let named_by = format!(" (named by {})", dir.named_by());
            SelectError::NoSuchKind { kind, dir: path, named_by, loaded, refused }
        }
        other => other,
    })?;
    manifest.check_drafter(&plugin.descriptor)?;
    let drafter = LoadedDrafter::load(&plugin, spec.artifact.as_deref(), &spec.options_toml())
        .map_err(|e| at_option_line(manifest, e))?;
    // Weights the drafter repacked for AMX's tiles leave their arrays in MLX's buffer cache, as
    // the target's do (see `model::load`): 3 to 9 MB for the demo drafters. Failing to empty it
    // costs memory only.
    let _ = mlx_rs::memory::clear_cache();
    let config =
        SpecConfig { tree_nodes: spec.tree_nodes, ..spec_config(spec.draft_tokens, spec.verify, &drafter.info) };
    Ok(Some((drafter, config)))
}

/// How a drafter drafts at a manifest's (or a bench's) draft length: `"auto"` up to
/// [`AUTO_MOST`] tokens, or the drafter's own maximum where that is less.
pub fn spec_config(draft_tokens: DraftTokens, verify: Verify, info: &plugin_api::ProviderInfo) -> SpecConfig {
    match draft_tokens {
        DraftTokens::Fixed(n) => SpecConfig::new(n as usize, verify),
        DraftTokens::Auto => {
            let most = match info.capabilities.max_draft_tokens as usize {
                0 => AUTO_MOST,
                max => max.min(AUTO_MOST),
            };
            SpecConfig { auto: true, ..SpecConfig::new(most, verify) }
        }
    }
}

/// A drafter's refusal of its options, placed at the manifest line of the option it names (the
/// SDK's messages name the option as `` `key` `` or begin with it), where one is named.
fn at_option_line(manifest: &Manifest, error: DrafterError) -> DrafterSetupError {
    let (DrafterError::Plugin { error: refusal, .. }, Some(spec)) = (&error, &manifest.drafter) else {
        return error.into();
    };
    let message = refusal.message.as_str();
    let named = |key: &str| message.contains(&format!("`{key}`")) || message.starts_with(&format!("{key} "));
    match spec.option_lines.iter().find(|(key, _)| refusal.kind == plugin_api::ErrorKind::INVALID_OPTIONS && named(key))
    {
        Some((key, line)) => crate::manifest::ManifestError {
            file: manifest.file.clone(),
            line: Some(*line),
            message: format!("drafter.options.{key}: {error}"),
        }
        .into(),
        None => error.into(),
    }
}

/// The object `host run --json` prints.
#[derive(Debug, Serialize)]
pub struct RunOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop: StopReason,
    pub stats: Stats,
    /// Per token, with `--logprobs`: `token`, `logprob` and the `top` alternatives as
    /// [id, logprob] pairs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plain: Option<PlainComparison>,
}

impl RunOutput {
    /// The human summary printed after a streamed generation.
    pub fn summary(&self) -> String {
        let mut out = summary(&self.stats, self.stop);
        if let Some(p) = &self.plain {
            out.push_str(&format!(
                "plain decoding of the same request: {:.0} ms, speculative {:.0} ms: the drafter ran it at {:.2}x plain speed; output {}\n",
                p.decode_ms,
                self.stats.decode_ms,
                p.speedup,
                match (p.first_difference, p.rejection) {
                    (None, _) => "identical".to_owned(),
                    (Some(_), true) => "differs (rejection sampling keeps the distribution, not the draws)".to_owned(),
                    (Some(at), false) => format!("DIFFERENT from generated token {at}"),
                }
            ));
        }
        out
    }

    /// The statistics as a table (`host run --stats`).
    pub fn stats_table(&self) -> String {
        let s = &self.stats;
        let mut rows = vec![
            ("stop", format!("{:?}", self.stop)),
            ("prompt tokens", s.prompt_tokens.to_string()),
            ("generated tokens", s.generated_tokens.to_string()),
            ("prefill", format!("{:.1} ms, {:.1} tok/s", s.prefill_ms, s.prefill_tokens_per_s)),
            ("decode", format!("{:.1} ms, {:.1} tok/s", s.decode_ms, s.decode_tokens_per_s)),
            ("target forwards", s.target_forwards.to_string()),
        ];
        if s.drafted > 0 || s.drafter_error.is_some() {
            rows.extend([
                ("rounds", s.rounds.to_string()),
                ("drafted", s.drafted.to_string()),
                ("accepted", format!("{} ({:.1}%)", s.accepted, 100.0 * s.acceptance_rate)),
                ("tokens per round (τ)", format!("{:.2}", s.mean_accept_len)),
                ("drafting", format!("{:.1} ms, {:.3} ms a round", s.draft_ms, per_round(s.draft_ms, s.rounds))),
                ("verifying", format!("{:.1} ms, {:.3} ms a round", s.verify_ms, per_round(s.verify_ms, s.rounds))),
            ]);
        }
        let mut out = String::new();
        for (name, value) in rows {
            out += &format!("{name:<22} {value}\n");
        }
        for (i, rate) in s.accepted_by_position.iter().enumerate() {
            out += &format!("{:<22} {:.2}\n", format!("accepted at draft {}", i + 1), rate);
        }
        if let Some(e) = &s.drafter_error {
            out += &format!("{:<22} {e}\n", "drafter dropped");
        }
        out
    }
}

fn summary(s: &Stats, stop: StopReason) -> String {
    let mut out = format!(
        "{} prompt tokens, {} generated ({:?}); prefill {:.0} ms ({:.1} tok/s), decode {:.1} tok/s, {} target forwards\n",
        s.prompt_tokens, s.generated_tokens, stop, s.prefill_ms, s.prefill_tokens_per_s, s.decode_tokens_per_s, s.target_forwards
    );
    if s.drafted > 0 || s.drafter_error.is_some() {
        let by_position: Vec<String> = s.accepted_by_position.iter().map(|r| format!("{r:.2}")).collect();
        out.push_str(&format!(
            "speculation: {} rounds, {} drafted, {} accepted ({:.1}%), mean accepted length {:.2}, by position [{}]; \
             a round {:.2} ms drafting, {:.2} ms verifying\n",
            s.rounds,
            s.drafted,
            s.accepted,
            100.0 * s.acceptance_rate,
            s.mean_accept_len,
            by_position.join(", "),
            per_round(s.draft_ms, s.rounds),
            per_round(s.verify_ms, s.rounds),
        ));
    }
    if let Some(e) = &s.drafter_error {
        out.push_str(&format!("the drafter was dropped, the rest decoded plainly: {e}\n"));
    }
    out
}

/// Milliseconds a round, of `ms` over `rounds`.
fn per_round(ms: f64, rounds: usize) -> f64 {
    ms / rounds.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::{first_difference, CheckpointDefaults};

    #[test]
    fn generation_config_values_of_the_wrong_type_or_range_are_refused_by_file_line_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let load = |body: &str| {
            std::fs::write(dir.path().join("generation_config.json"), body).unwrap();
            CheckpointDefaults::load(dir.path())
        };
        let good = load("{\n  \"temperature\": 0.7,\n  \"top_k\": 64,\n  \"eos_token_id\": [1, 6]\n}").unwrap();
        assert_eq!((good.temperature, good.top_k, good.eos), (Some(0.7), Some(64), vec![1, 6]));
        for (body, says) in [
            ("{\n  \"temperature\": \"hot\"\n}", ":2: temperature: expected a number, got \"hot\""),
            ("{\"do_sample\": true,\n \"top_k\": \"many\"}", ":2: top_k: expected a number, got \"many\""),
            ("{\"top_k\": 2.5}", ":1: top_k: expected a whole number >= 0 (0 = off), got 2.5"),
            ("{\"top_p\": 1.5}", ":1: top_p: top_p must be in (0, 1] (1 = off), got 1.5"),
            ("{\"do_sample\": \"yes\"}", ":1: do_sample: expected true or false"),
            ("{\"eos_token_id\": [1, \"x\"]}", ":1: eos_token_id: expected a token id or a list of them"),
        ] {
            let error = load(body).unwrap_err();
            assert!(error.contains(&format!("generation_config.json{says}")), "{body}: {error}");
        }
    }

    #[test]
    fn the_first_difference_is_the_first_unequal_token_or_where_the_shorter_ends() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_difference(&[], &[4]), Some(0));
    }
}
