//! `host bench --sweep`: drafters × draft lengths on a file of prompts, against plain decoding
//! of the same target. For each prompt, plain decoding runs before and after every drafter and
//! draft length (their order reversed on every other prompt, so that drift hits both ends
//! alike); a configuration's speed-up on that prompt is the mean of the two plain times over its
//! own time. Greedy, and with a temperature also sampled, each drafter verified as its manifest
//! says (`match`, or `rejection` for a drafter that returns probabilities: a manifest with
//! `verify = "rejection"` runs sampled only).

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use serde::Serialize;

use super::summary;
use crate::generate::{generate, GenerateError, Generation, Request};
use crate::manifest::{DraftTokens, Manifest};
use crate::model::Gemma4;
use crate::plugin::LoadedDrafter;
use crate::plugins_dir::PluginsDir;
use crate::run::{
    first_difference, load_drafter, resolve_request, spec_config, CheckpointDefaults, Overrides, RunError,
};
use crate::speculative::{generate_speculative, probe_open, SpecConfig, Verify};
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// Manifests with a [drafter], all on one target.
    pub manifests: Vec<PathBuf>,
    /// One JSON object per line with a `prompt` (and optionally an `id`).
    pub prompts_file: PathBuf,
    pub draft_tokens: Vec<DraftTokens>,
    /// The draft lengths of the sampled runs (default: `draft_tokens`).
    pub sampled_draft_tokens: Vec<DraftTokens>,
    pub max_tokens: u32,
    /// Adds sampled runs at this temperature (with `top_p`) to the greedy ones.
    pub temperature: Option<f32>,
    pub top_p: f32,
    /// Each drafter at each length as a chain and as a tree of as many drafts, whatever its
    /// manifest's `tree_nodes`: the same verify width two ways.
    pub equal_width_trees: bool,
    pub plugins_dir: PluginsDir,
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Setup(#[from] RunError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error("{path}: {reason}")]
    Prompts { path: PathBuf, reason: String },
    #[error("--sweep: {0} has no [drafter]")]
    NoDrafter(PathBuf),
    #[error("--sweep: {0} has another target than {1} ({2} against {3})")]
    Targets(PathBuf, PathBuf, PathBuf, PathBuf),
    #[error("--sweep: give at least one manifest and one draft length")]
    Empty,
}

/// One drafter at one draft length in one sampling mode, over every prompt.
#[derive(Debug, Serialize)]
pub struct SweepRow {
    /// The manifest's file stem (`demo-dflash`), with [`TREES`] after it for
    /// `--equal-width-trees`' trees.
    pub drafter: String,
    pub kind: String,
    /// The draft length; under `"auto"`, the most.
    pub draft_tokens: usize,
    /// `draft_tokens = "auto"`: each round as deep as pays.
    pub auto_draft_tokens: bool,
    /// The most drafts of a row's tree (the manifest's `tree_nodes`); 0: chains.
    pub tree_nodes: usize,
    /// `greedy`, or the verification of a sampled run (the manifest's): `match` or `rejection`.
    pub mode: String,
    /// Generated tokens per target forward, over all prompts.
    pub tau: f64,
    pub acceptance_by_position: Vec<f64>,
    pub target_forwards: usize,
    pub plain_forwards: usize,
    /// Plain time / speculative time per prompt.
    pub speedups: Vec<f64>,
    pub speedup_median: f64,
    pub speedup_min: f64,
    pub speedup_max: f64,
    /// Prompts whose output equalled plain decoding's (expected of all but `rejection`).
    pub identical: usize,
    /// Per prompt, the first generated position at which the output parted from plain
    /// decoding's; none where it did not.
    pub first_difference: Vec<Option<usize>>,
    /// Mean time a round spent in the drafter's calls, and in the target's verify forward with
    /// its sampling and acceptance (`Stats::draft_ms`, `Stats::verify_ms`).
    pub draft_ms_per_round: f64,
    pub verify_ms_per_round: f64,
    /// Plain decoding's mean time per token on the same prompts, timed around this row's runs.
    pub plain_ms_per_token: f64,
}

#[derive(Debug, Serialize)]
pub struct SweepReport {
    pub prompts: usize,
    pub max_tokens: usize,
    pub temperature: Option<f32>,
    pub top_p: f32,
    /// Plain decoding's median tokens/s (greedy).
    pub plain_tokens_per_s: f64,
    pub rows: Vec<SweepRow>,
}

struct Drafter {
    name: String,
    loaded: LoadedDrafter,
    verify: Verify,
    tree_nodes: usize,
}

/// What `--equal-width-trees` adds to the name of a tree's rows.
pub const TREES: &str = " trees";

/// How a configuration's rows draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// As the manifest says: trees of its `tree_nodes`, or chains.
    Manifest,
    Chain,
    /// Trees of as many drafts as the chain's draft length (under `"auto"`, its most): the
    /// verify forward a chain of that length would have.
    EqualWidthTree,
}

impl Drafter {
    /// How it drafts at `draft_tokens`, shaped as `shape` says.
    fn config(&self, draft_tokens: DraftTokens, verify: Verify, shape: Shape) -> SpecConfig {
        let config = spec_config(draft_tokens, verify, &self.loaded.info);
        let tree_nodes = match shape {
            Shape::Manifest => self.tree_nodes,
            Shape::Chain => 0,
            Shape::EqualWidthTree => config.draft_tokens,
        };
        SpecConfig { tree_nodes, ..config }
    }

    /// Its name in the report: the manifest's, and [`TREES`] after it for trees of the chain's
    /// width.
    fn label(&self, shape: Shape) -> String {
        match shape {
            Shape::EqualWidthTree => format!("{}{TREES}", self.name),
            _ => self.name.clone(),
        }
    }
}

/// Counts for one row, summed over prompts.
#[derive(Default)]
struct Tally {
    generated: usize,
    forwards: usize,
    plain_forwards: usize,
    drafted: Vec<usize>,
    accepted: Vec<usize>,
    speedups: Vec<f64>,
    first_difference: Vec<Option<usize>>,
    rounds: usize,
    draft_ms: f64,
    verify_ms: f64,
    plain_ms: f64,
    plain_tokens: usize,
}

pub fn sweep(options: &SweepOptions) -> Result<SweepReport, SweepError> {
    if options.manifests.is_empty() || options.draft_tokens.is_empty() {
        return Err(SweepError::Empty);
    }
    let (model, tokenizer, manifest, drafters) = setup(options)?;
    let prompts = read_prompts(&options.prompts_file)?;
    // Greedy first, then sampled; a greedy run is verified by match whatever the manifest says.
    let mut modes = vec![0.0];
    if let Some(t) = options.temperature.filter(|&t| t > 0.0) {
        modes.push(t);
    }
    let lengths = |m: usize| match m {
        0 => &options.draft_tokens,
        _ if options.sampled_draft_tokens.is_empty() => &options.draft_tokens,
        _ => &options.sampled_draft_tokens,
    };
    let shapes: &[Shape] =
        if options.equal_width_trees { &[Shape::Chain, Shape::EqualWidthTree] } else { &[Shape::Manifest] };
    let configs: Vec<(usize, usize, DraftTokens, Shape)> = (0..modes.len())
        .flat_map(|m| {
            let drafters = &drafters;
            (0..drafters.len()).flat_map(move |d| {
                lengths(m).iter().flat_map(move |&n| shapes.iter().map(move |&shape| (m, d, n, shape)))
            })
        })
        .filter(|&(m, d, _, _)| m > 0 || drafters[d].verify == Verify::Match)
        .collect();
    let mut tallies: Vec<Tally> = configs.iter().map(|_| Tally::default()).collect();
    let mut plain_rates = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        for (m, &temperature) in modes.iter().enumerate() {
            let overrides = Overrides {
                prompt: Some(prompt.clone()),
                max_tokens: Some(options.max_tokens),
                temperature: Some(temperature),
                top_p: Some(options.top_p),
                seed: Some(i as u64),
                ..Overrides::default()
            };
            let mut request =
                resolve_request(&manifest, &overrides, &model, &tokenizer, &CheckpointDefaults::default())
                    .map_err(RunError::from)?;
            request.eos.clear();
            if i == 0 {
                // Warm-up, untimed: plain decoding and every drafter once.
                timed_plain(&model, &request)?;
                for d in drafters.iter().filter(|d| m > 0 || d.verify == Verify::Match) {
                    let config = d.config(lengths(m)[0], d.verify, shapes[shapes.len() - 1]);
                    generate_speculative(&model, &d.loaded, &request, config, |_| {})?;
                }
            }
            let (before, plain) = timed_plain(&model, &request)?;
            let mut order: Vec<usize> = (0..configs.len()).filter(|&c| configs[c].0 == m).collect();
            if i % 2 == 1 {
                order.reverse();
            }
            let mut spec_runs = Vec::new();
            for &c in &order {
                let (_, d, n, shape) = configs[c];
                let config = drafters[d].config(n, drafters[d].verify, shape);
                let start = Instant::now();
                let g = generate_speculative(&model, &drafters[d].loaded, &request, config, |_| {})?;
                spec_runs.push((c, start.elapsed().as_secs_f64(), g));
            }
            let (after, _) = timed_plain(&model, &request)?;
            let plain_s = (before + after) / 2.0;
            if m == 0 {
                plain_rates.push(plain.tokens.len() as f64 / plain_s);
            }
            for (c, seconds, g) in spec_runs {
                tallies[c].add(&plain, plain_s, &g, seconds);
            }
        }
    }
    let rows = configs
        .iter()
        .zip(tallies)
        .map(|(&(m, d, n, shape), t)| {
            let mode = match (m, drafters[d].verify) {
                (0, _) => "greedy",
                (_, Verify::Match) => "match",
                (_, Verify::Rejection) => "rejection",
            };
            t.row(&drafters[d], n, mode, shape)
        })
        .collect();
    Ok(SweepReport {
        prompts: prompts.len(),
        max_tokens: options.max_tokens as usize,
        temperature: options.temperature,
        top_p: options.top_p,
        plain_tokens_per_s: summary(&plain_rates).0,
        rows,
    })
}

fn timed_plain(model: &Gemma4, request: &Request) -> Result<(f64, Generation), GenerateError> {
    let start = Instant::now();
    let g = generate(model, request, |_| {})?;
    Ok((start.elapsed().as_secs_f64(), g))
}

impl Tally {
    fn add(&mut self, plain: &Generation, plain_s: f64, spec: &Generation, spec_s: f64) {
        let s = &spec.stats;
        self.rounds += s.rounds;
        self.draft_ms += s.draft_ms;
        self.verify_ms += s.verify_ms;
        self.plain_ms += plain_s * 1e3;
        self.plain_tokens += plain.tokens.len();
        self.generated += s.generated_tokens;
        self.forwards += s.target_forwards;
        self.plain_forwards += plain.stats.target_forwards;
        for (k, (&drafted, &rate)) in s.drafted_by_position.iter().zip(&s.accepted_by_position).enumerate() {
            if self.drafted.len() <= k {
                self.drafted.push(0);
                self.accepted.push(0);
            }
            self.drafted[k] += drafted;
            self.accepted[k] += (rate * drafted as f64).round() as usize;
        }
        self.speedups.push(plain_s / spec_s);
        self.first_difference.push(first_difference(&plain.tokens, &spec.tokens));
    }

    fn row(self, drafter: &Drafter, draft_tokens: DraftTokens, mode: &str, shape: Shape) -> SweepRow {
        let (median, min, max) = summary(&self.speedups);
        let config = drafter.config(draft_tokens, Verify::Match, shape);
        SweepRow {
            drafter: drafter.label(shape),
            kind: drafter.loaded.kind().to_owned(),
            draft_tokens: config.draft_tokens,
            auto_draft_tokens: config.auto,
            tree_nodes: config.tree_nodes,
            mode: mode.to_owned(),
            tau: self.generated as f64 / self.forwards.max(1) as f64,
            acceptance_by_position: self
                .drafted
                .iter()
                .zip(&self.accepted)
                .map(|(&d, &a)| a as f64 / d.max(1) as f64)
                .collect(),
            target_forwards: self.forwards,
            plain_forwards: self.plain_forwards,
            speedups: self.speedups,
            speedup_median: median,
            speedup_min: min,
            speedup_max: max,
            identical: self.first_difference.iter().filter(|d| d.is_none()).count(),
            first_difference: self.first_difference,
            draft_ms_per_round: self.draft_ms / self.rounds.max(1) as f64,
            verify_ms_per_round: self.verify_ms / self.rounds.max(1) as f64,
            plain_ms_per_token: self.plain_ms / self.plain_tokens.max(1) as f64,
        }
    }
}

type Setup = (Rc<Gemma4>, Tokenizer, Manifest, Vec<Drafter>);

/// The shared target (from the first manifest) and every manifest's drafter, opened against it.
fn setup(options: &SweepOptions) -> Result<Setup, SweepError> {
    let first = Manifest::load(&options.manifests[0]).map_err(RunError::from)?;
    let model = Rc::new(crate::model::load(&first.target_model).map_err(RunError::from)?);
    let tokenizer = Tokenizer::load(&first.target_model).map_err(RunError::from)?;
    let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_owned());
    let mut drafters = Vec::new();
    for path in &options.manifests {
        let manifest = Manifest::load(path).map_err(RunError::from)?;
        if canonical(&manifest.target_model) != canonical(&first.target_model) {
            return Err(SweepError::Targets(
                path.clone(),
                options.manifests[0].clone(),
                manifest.target_model.clone(),
                first.target_model.clone(),
            ));
        }
        let Some((loaded, config)) = load_drafter(&manifest, &options.plugins_dir).map_err(RunError::from)? else {
            return Err(SweepError::NoDrafter(path.clone()));
        };
        probe_open(&model, &loaded).map_err(RunError::from)?;
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        drafters.push(Drafter { name, loaded, verify: config.verify, tree_nodes: config.tree_nodes });
    }
    Ok((model, tokenizer, first, drafters))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    #[allow(dead_code)]
    id: Option<String>,
    prompt: String,
}

fn read_prompts(path: &Path) -> Result<Vec<String>, SweepError> {
    let error = |reason: String| SweepError::Prompts { path: path.to_owned(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    let prompts: Vec<String> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            serde_json::from_str::<PromptLine>(l).map(|p| p.prompt).map_err(|e| error(format!("line {}: {e}", n + 1)))
        })
        .collect::<Result<_, _>>()?;
    if prompts.is_empty() {
        return Err(error("no prompts".into()));
    }
    Ok(prompts)
}

impl SweepReport {
    /// A Markdown table, one row per drafter, draft length and mode.
    pub fn text(&self) -> String {
        let mut out = format!(
            "{} held-out prompts × {} tokens; plain decoding {:.1} tok/s (greedy, median). Speed-up is plain \
             time over speculative time per prompt: median [min, max]. A round's cost is its mean time drafting + verifying, \
             in ms and in plain decoding's steps (its time per token on the same prompts).\n\n\
             | drafter | mode | γ | τ | speed-up | range | a round: draft + verify, ms (steps) | target forwards (plain) | identical | acceptance by position |\n\
             |---|---|---|---|---|---|---|---|---|---|\n",
            self.prompts, self.max_tokens, self.plain_tokens_per_s,
        );
        for r in &self.rows {
            let step = r.plain_ms_per_token.max(f64::MIN_POSITIVE);
            let by_position: Vec<String> = r.acceptance_by_position.iter().map(|a| format!("{a:.2}")).collect();
            let mode = match r.mode.as_str() {
                "greedy" => "greedy".to_owned(),
                m => format!("T={} {m}", self.temperature.unwrap_or(0.0)),
            };
            out.push_str(&format!(
                "| {} | {mode} | {} | {:.2} | {:.2}× | [{:.2}, {:.2}] | {:.2} + {:.2} ({:.1} + {:.1}) | {} ({}) | {}/{} | {} |\n",
                r.drafter,
                if r.auto_draft_tokens { "auto".to_owned() } else { r.draft_tokens.to_string() },
                r.tau,
                r.speedup_median,
                r.speedup_min,
                r.speedup_max,
                r.draft_ms_per_round,
                r.verify_ms_per_round,
                r.draft_ms_per_round / step,
                r.verify_ms_per_round / step,
                r.target_forwards,
                r.plain_forwards,
                r.identical,
                self.prompts,
                by_position.join(" ")
            ));
        }
        out
    }
}
