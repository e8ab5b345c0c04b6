//! Trees of drafts (the extension `draft-tree/1`) are lossless: output equals plain decoding
//! token for token, greedy and sampled with a seed, whatever branch the target agrees with,
//! past the sliding window, in batches; a drafter without trees drafts chains in a host that
//! asks for trees.

mod common;

use std::path::{Path, PathBuf};
use std::rc::Rc;

use host::generate::{generate, Generation, Request};
use host::model::{load, Gemma4};
use host::plugin::load::load as load_library;
use host::plugin::LoadedDrafter as HostDrafter;
use host::sampling::SamplingParams;
use host::speculative::{generate_speculative, generate_speculative_rows, SpecConfig, Verify};
use mlx_rs::Array;
use plugin_api::abi::{RowState, TokenRows};
use plugin_api::draft_tree::Tree;
use plugin_api::sdk::{self, DraftProvider, Drafter, GroupedDraftProvider, Options, Proposal, Target, TreeProposal};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

use common::mix;

// --- a drafter of random trees, one branch of which follows the plain output for a while ----

struct Branches;
struct BranchesProvider {
    seed: u64,
    script: Vec<u32>,
}
struct BranchesRows {
    seed: u64,
    vocab: u32,
    rows: usize,
    script: Vec<u32>,
}

impl Drafter for Branches {
    type Provider = BranchesProvider;
    fn descriptor() -> Descriptor {
        Descriptor::new("branches", "random trees for tests", "0.0.0").option("seed", "0", "").option(
            "script",
            "[]",
            "the plain output, which one branch copies in part",
        )
    }
    fn load(_: Option<&Path>, o: &Options) -> Result<BranchesProvider, PluginError> {
        Ok(BranchesProvider { seed: o.value("seed")?, script: o.value("script")? })
    }
}

impl DraftProvider for BranchesProvider {
    type Rows = BranchesRows;
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "branches".into(),
            weights_bytes: 0,
            namespace: "branches".into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }
    fn open(&self, target: Target, rows: usize) -> Result<BranchesRows, PluginError> {
        let vocab = target.info().vocab_size;
        Ok(BranchesRows { seed: self.seed, vocab, rows, script: self.script.clone() })
    }
}

impl BranchesRows {
    /// Up to three children under each node of the script's branch, at a random place among
    /// its siblings; the branch leaves the script at a random depth.
    fn tree(&self, step: u64, depth: usize, nodes: usize) -> Tree {
        let mut r = mix(self.seed ^ mix(step));
        let mut next = || {
            r = mix(r);
            r
        };
        let mut tree = Tree::default();
        let right = (next() % (depth as u64 + 1)) as usize;
        let mut parent = None;
        for d in 0..depth {
            let children = 1 + (next() % 3) as usize;
            let place = (next() % children as u64) as usize;
            let mut on_branch = None;
            for c in 0..children {
                if tree.len() == nodes {
                    return tree;
                }
                let scripted = self.script.get(step as usize + d).copied().filter(|_| c == place && d < right);
                let token = scripted.unwrap_or_else(|| (next() % self.vocab as u64) as u32);
                if tree.child(parent, token).is_some() {
                    continue;
                }
                let node = tree.push(parent, token);
                if c == place {
                    on_branch = Some(node);
                }
            }
            parent = on_branch;
            if parent.is_none() {
                break;
            }
        }
        tree
    }
}

impl GroupedDraftProvider for BranchesRows {
    fn prefill(&mut self, _: TokenRows<'_>, _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    /// No chains: whatever a run drafts came as trees.
    fn draft(&mut self, pending: &[u32], _: usize, _: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        Ok(pending.iter().map(|_| Proposal::default()).collect())
    }
    fn draft_tree(
        &mut self,
        pending: &[u32],
        depth: usize,
        nodes: usize,
        steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        let trees = steps
            .iter()
            .take(pending.len())
            .map(|&s| TreeProposal { tree: self.tree(s, depth, nodes), probabilities: None });
        Ok(Some(trees.collect()))
    }
    fn commit(&mut self, _: TokenRows<'_>, _: &[u32], _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
        self.rows = keep.len();
        Ok(())
    }
    fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
        self.rows += states.len();
        Ok(())
    }
    fn capture(&mut self, _: usize) -> Result<RowState, PluginError> {
        Ok(RowState {
            namespace: "branches".into(),
            processed: 0,
            ids: Default::default(),
            tensors: Default::default(),
        })
    }
}

fn branches(seed: u64, script: &[u32]) -> HostDrafter {
    let options = format!("seed = {seed}\nscript = {script:?}");
    HostDrafter::load_root(sdk::root_module::<Branches>(), "branches", None, &options).unwrap()
}

// --- targets, requests, runs -----------------------------------------------------------------

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// The trained bfloat16 demo target (a window of 128, two layers sharing others' keys) and its
/// tokenizer.
fn demo_target() -> (Rc<Gemma4>, host::tokenizer::Tokenizer) {
    host::runtime::init();
    let dir = models().join("kjv-gemma4");
    (Rc::new(load(&dir).unwrap()), host::tokenizer::Tokenizer::load(&dir).unwrap())
}

/// The bfloat16 test fixture: a window of 16.
fn small_target() -> Rc<Gemma4> {
    host::runtime::init();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/bf16");
    assert!(dir.join("config.json").exists(), "{} is missing: run `make oracle`", dir.display());
    Rc::new(load(&dir).unwrap())
}

fn trees(depth: usize, nodes: usize) -> SpecConfig {
    SpecConfig { tree_nodes: nodes, ..SpecConfig::new(depth, Verify::Match) }
}

fn spec(model: &Rc<Gemma4>, drafter: &HostDrafter, request: &Request, config: SpecConfig) -> Generation {
    generate_speculative(model, drafter, request, config, |_| {}).unwrap()
}

fn plain(model: &Gemma4, request: &Request) -> Vec<u32> {
    generate(model, request, |_| {}).unwrap().tokens
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, min_p: 0.0, seed }
}

/// The trained demo drafter of this kind (`models/kjv-gemma4-<kind>`).
fn trained(kind: &str) -> HostDrafter {
    let plugin = load_library(&common::workspace_plugin(kind), None).unwrap();
    HostDrafter::load(&plugin, Some(&models().join(format!("kjv-gemma4-{kind}"))), "").unwrap()
}

fn lookup() -> HostDrafter {
    trained("lookup")
}

/// Openings of held-out chapters.
const OPENINGS: [&str; 3] = [
    "And Abraham journeyed from thence toward the south country, and dwelled between Kadesh and Shur.\n",
    "Why do the heathen rage, and the people imagine a vain thing?\n",
    "And he entered again into the synagogue; and there was a man there which had a withered hand.\n",
];

#[test]
fn random_trees_equal_plain_decoding_greedy_and_sampled_past_the_window() {
    let m = small_target();
    for (i, sampling) in [SamplingParams::default(), sampled(7)].into_iter().enumerate() {
        let r = Request { prompt: vec![2, 17, 40, 9, 33, 17, 40, 9], max_tokens: 70, sampling, ..Default::default() };
        let expected = plain(&m, &r);
        for (depth, nodes) in [(1, 3), (3, 8), (5, 16)] {
            let g = spec(&m, &branches(i as u64 + depth as u64, &expected), &r, trees(depth, nodes));
            assert_eq!(g.tokens, expected, "depth {depth}, {nodes} nodes, {:?}", r.sampling);
            assert!(g.stats.drafter_error.is_none(), "{:?}", g.stats.drafter_error);
            assert!(g.stats.accepted > 0 && g.stats.drafted > g.stats.accepted, "{:?}", g.stats);
        }
    }
}

#[test]
fn trees_on_the_demo_target_equal_plain_greedy_past_its_window() {
    let (m, tokenizer) = demo_target();
    let prompt = tokenizer.encode(OPENINGS[0]).unwrap();
    let r = Request { prompt, max_tokens: 170, ..Default::default() };
    let expected = plain(&m, &r);
    let g = spec(&m, &branches(3, &expected), &r, trees(4, 12));
    assert_eq!(g.tokens, expected, "random trees");
    // The drafters' own trees; with no more nodes than its depth the assistant's tree is its
    // chain, verified as one.
    for (kind, nodes) in [("lookup", 12), ("dflash", 12), ("deepspec", 12), ("assistant", 12), ("assistant", 4)] {
        let g = spec(&m, &trained(kind), &r, trees(4, nodes));
        assert_eq!(g.tokens, expected, "{kind}'s trees of {nodes}");
        assert!(g.stats.accepted > 0 && g.stats.drafter_error.is_none(), "{kind}: {:?}", g.stats);
    }
    // Under "auto", each round's depth and tree size as pay.
    let auto = SpecConfig { auto: true, ..trees(8, 16) };
    let g = spec(&m, &lookup(), &r, auto);
    assert_eq!(g.tokens, expected, "lookup's trees under \"auto\"");
    assert!(g.stats.accepted > 0, "{:?}", g.stats);
}

#[test]
fn a_batch_of_trees_equals_its_rows_alone() {
    let (m, tokenizer) = demo_target();
    let requests: Vec<Request> = OPENINGS
        .iter()
        .enumerate()
        .map(|(i, text)| Request {
            prompt: tokenizer.encode(text).unwrap(),
            max_tokens: 40 + 25 * i,
            sampling: if i == 1 { sampled(5) } else { SamplingParams::default() },
            ..Default::default()
        })
        .collect();
    let drafter = lookup();
    let together = generate_speculative_rows(&m, &drafter, &requests, trees(4, 10), |_, _| {}).unwrap();
    for (i, (request, g)) in requests.iter().zip(&together).enumerate() {
        assert_eq!(g.tokens, plain(&m, request), "row {i}");
        assert!(g.stats.drafter_error.is_none());
    }
}

/// Rows join a running batch of trees between rounds and leave when they finish or are
/// cancelled, greedy and sampled, some with penalties; each equals its plain decoding.
#[test]
fn trees_with_rows_joining_and_leaving_mid_flight_equal_single_runs() {
    let (m, tokenizer) = demo_target();
    let tokens = tokenizer.encode(&OPENINGS.concat()).unwrap();
    let penalties = host::sampling::Penalties { frequency_penalty: 0.6, presence_penalty: 0.3, ..Default::default() };
    let requests: Vec<Request> = (0..5)
        .map(|i| Request {
            prompt: tokens[..12 + 9 * i].to_vec(),
            max_tokens: 40 + 11 * i,
            sampling: if i % 2 == 0 { SamplingParams::default() } else { sampled(40 + i as u64) },
            penalties: if i % 3 == 1 { penalties.clone() } else { Default::default() },
            ..Default::default()
        })
        .collect();
    common::join_and_leave_mid_flight(&m, &requests, &lookup(), trees(4, 10));
}

#[test]
fn a_drafter_without_trees_drafts_chains_in_a_host_that_asks_for_trees() {
    let m = small_target();
    let r = Request { prompt: vec![2, 17, 40, 9, 33, 17, 40, 9], max_tokens: 40, ..Default::default() };
    let plugin = load_library(&common::workspace_plugin("ngram"), None).unwrap();
    let ngram = HostDrafter::load(&plugin, None, "").unwrap();
    let g = spec(&m, &ngram, &r, trees(4, 8));
    assert_eq!(g.tokens, plain(&m, &r));
    assert!(g.stats.drafted > 0 && g.stats.drafter_error.is_none(), "{:?}", g.stats);
}

// --- rejection over trees --------------------------------------------------------------------

/// Trees of three siblings drawn without replacement from [`Q`] over its candidates, each
/// with the distribution it was drawn from.
struct Siblings;
struct SiblingsRows {
    vocab: u32,
    candidates: Vec<u32>,
}

/// q over the candidates: unlike the target's p, and with mass on a token p never emits.
const Q: [f64; 5] = [0.40, 0.10, 0.10, 0.15, 0.25];

impl Drafter for Siblings {
    type Provider = SiblingsProvider;
    fn descriptor() -> Descriptor {
        Descriptor::new("siblings", "trees of three siblings for tests", "0.0.0")
            .capabilities(Capabilities { draft_probabilities: true, ..Capabilities::default() })
            .option("candidates", "", "the tokens drawn from, one per entry of q")
    }
    fn load(_: Option<&Path>, o: &Options) -> Result<SiblingsProvider, PluginError> {
        Ok(SiblingsProvider { candidates: o.value("candidates")? })
    }
}

struct SiblingsProvider {
    candidates: Vec<u32>,
}

impl DraftProvider for SiblingsProvider {
    type Rows = SiblingsRows;
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "siblings".into(),
            weights_bytes: 0,
            namespace: "siblings".into(),
            trained_depth: 0,
            capabilities: Capabilities { draft_probabilities: true, ..Capabilities::default() },
        }
    }
    fn open(&self, target: Target, _rows: usize) -> Result<SiblingsRows, PluginError> {
        Ok(SiblingsRows { vocab: target.info().vocab_size, candidates: self.candidates.clone() })
    }
}

impl GroupedDraftProvider for SiblingsRows {
    fn prefill(&mut self, _: TokenRows<'_>, _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn draft(&mut self, pending: &[u32], _: usize, _: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        Ok(pending.iter().map(|_| Proposal::default()).collect())
    }
    fn draft_tree(
        &mut self,
        pending: &[u32],
        _: usize,
        nodes: usize,
        steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        let trees = (0..pending.len()).map(|row| {
            let mut r = mix(steps[row] ^ mix(row as u64 ^ 0x5151));
            let mut left = Q.to_vec();
            let (mut tree, mut rows) = (Tree::default(), Vec::new());
            for _ in 0..nodes.min(3) {
                let mass: f64 = left.iter().sum();
                let mut q = vec![0f32; self.vocab as usize];
                for (&t, &l) in self.candidates.iter().zip(&left) {
                    q[t as usize] = (l / mass) as f32;
                }
                r = mix(r);
                let mut u = (r >> 11) as f64 / (1u64 << 53) as f64 * mass;
                let pick = left.iter().position(|&l| {
                    u -= l;
                    u < 0.0 && l > 0.0
                });
                let pick = pick.unwrap_or_else(|| left.iter().rposition(|&l| l > 0.0).unwrap());
                left[pick] = 0.0;
                tree.push(None, self.candidates[pick]);
                rows.extend(q);
            }
            let probabilities = Array::from_slice(&rows, &[tree.len() as i32, self.vocab as i32]);
            TreeProposal { tree, probabilities: Some(probabilities) }
        });
        Ok(Some(trees.collect()))
    }
    fn commit(&mut self, _: TokenRows<'_>, _: &[u32], _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn filter_rows(&mut self, _: &[u32]) -> Result<(), PluginError> {
        Ok(())
    }
    fn append(&mut self, _: Vec<RowState>) -> Result<(), PluginError> {
        Ok(())
    }
    fn capture(&mut self, _: usize) -> Result<RowState, PluginError> {
        Ok(RowState {
            namespace: "siblings".into(),
            processed: 0,
            ids: Default::default(),
            tensors: Default::default(),
        })
    }
}

#[test]
fn rejection_over_trees_emits_the_targets_distribution() {
    let m = small_target();
    let p = common::first_token_distribution(&m, &Default::default());
    assert_eq!(p.len(), 4);
    let outside = (0..m.config.vocab_size as usize).find(|t| !p.iter().any(|(i, _)| i == t)).unwrap();
    // p's least likely token first: q favours it over what p gives it.
    let mut by_p = p.clone();
    by_p.sort_by(|a, b| a.1.total_cmp(&b.1));
    let candidates: Vec<u32> = by_p.iter().map(|&(t, _)| t as u32).chain([outside as u32]).collect();
    let options = format!("candidates = {candidates:?}");
    let drafter = HostDrafter::load_root(sdk::root_module::<Siblings>(), "siblings", None, &options).unwrap();
    let config = SpecConfig { tree_nodes: 3, ..SpecConfig::new(1, Verify::Rejection) };
    let (drafted, accepted) =
        common::assert_rejection_keeps_the_first_token_distribution(&m, &drafter, config, &Default::default());
    let runs = 900;
    assert!(accepted > 0 && accepted < runs, "both acceptance and resampling must occur: {accepted} of {runs} rounds");
    assert!(drafted > 2 * runs, "trees of three: {drafted} drafts in {runs} runs");
}

/// Penalties move each node by the tokens of its own path, and log-probabilities are the
/// target's at each position: under trees, as plain decoding gives them.
#[test]
fn penalties_and_logprobs_under_trees_equal_plain_decoding() {
    let m = small_target();
    let penalties = host::sampling::Penalties {
        frequency_penalty: 0.6,
        presence_penalty: 0.3,
        repetition_penalty: 1.4,
        repetition_context_size: 6,
        logit_bias: vec![(17, -4.0), (40, 2.0)],
    };
    for sampling in [SamplingParams::default(), sampled(11)] {
        let r = Request {
            prompt: vec![2, 17, 40, 9, 33, 17, 40, 9],
            max_tokens: 40,
            sampling,
            penalties: penalties.clone(),
            logprobs: Some(5),
            ..Default::default()
        };
        let plain = generate(&m, &r, |_| {}).unwrap();
        let g = spec(&m, &branches(9, &plain.tokens), &r, trees(4, 10));
        assert_eq!(g.tokens, plain.tokens, "{sampling:?}");
        assert!(g.stats.accepted > 0, "{:?}", g.stats);
        assert_eq!(g.logprobs.len(), plain.logprobs.len());
        for (a, b) in g.logprobs.iter().zip(&plain.logprobs) {
            assert_eq!((a.token, a.top.len()), (b.token, b.top.len()));
            assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} {b:?}");
            for (x, y) in a.top.iter().zip(&b.top) {
                assert!(x.0 == y.0 && (x.1 - y.1).abs() < 1e-4, "{a:?} {b:?}");
            }
        }
    }
}
