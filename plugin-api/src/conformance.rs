//! The conformance kit (feature `conformance`): drives a drafter through its whole lifecycle
//! against a [`SyntheticTarget`] and checks the contract. It goes through the same ABI objects
//! the host uses, so a plugin that passes here behaves at the boundary.
//!
//! ```ignore
//! let report = plugin_api::conformance::check::<MyDrafter>(&Config::default());
//! report.assert_passed();
//! ```
//! [`check_root`] does the same for any loaded root module.

use std::fmt;
use std::path::PathBuf;

use std::cell::Cell;
use std::rc::Rc;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RResult, RSome, RVec};
use mlx_rs::ops::broadcast_to;
use mlx_rs::{random, Array, Dtype};

use crate::abi::{DraftRow, DrafterRootRef, RowGroupBox, RowState, TokenRows};
use crate::device_draft::{DeviceDraft, DEVICE_DRAFT_ID};
use crate::draft_tree::{DraftTree, Tree, TreeRow, DRAFT_TREE_ID};
use crate::target::{DonorLayer, Donors, LayerKind, TargetInfo, TargetViewAbi, TargetViewAbi_TO, TargetViewBox};
use crate::{sdk, ArrayRef, OwnedArray, PluginError, ProviderInfo};

/// A target with random weights and no model behind it: sizes, an embedding table, a tied
/// head, and a fixed random K/V for the donor layers (the same for every row). Enough for
/// drafters to be opened and driven.
#[derive(Clone)]
pub struct SyntheticTarget {
    info: TargetInfo,
    embedding: Array,
    /// Keys and values [1, 1, DONOR_SLOTS, head dim] of the sliding and the full donor.
    sliding: (Array, Array),
    full: (Array, Array),
    /// Rows of the group this view serves (donors are lent per row).
    rows: Rc<Cell<usize>>,
}

/// Positions the synthetic donors hold.
const DONOR_SLOTS: i32 = 16;

impl SyntheticTarget {
    pub fn new(vocab_size: u32, hidden_size: u32, num_layers: u32, seed: u64) -> Result<Self, PluginError> {
        Self::with_heads(vocab_size, hidden_size, num_layers, hidden_size / 2, hidden_size / 2, 8, seed)
    }

    /// A target whose sliding layers have `head_dim`, full layers `global_head_dim`, and a
    /// sliding window of `sliding_window`.
    pub fn with_heads(
        vocab_size: u32,
        hidden_size: u32,
        num_layers: u32,
        head_dim: u32,
        global_head_dim: u32,
        sliding_window: u32,
        seed: u64,
    ) -> Result<Self, PluginError> {
        let key = random::key(seed)?;
        let embedding = random::normal::<f32>(&[vocab_size as i32, hidden_size as i32], None, 0.02, &key)?;
        let kv = |dim: u32, k: u64| -> Result<(Array, Array), PluginError> {
            let shape = [1, 1, DONOR_SLOTS, dim as i32];
            let keys = random::normal::<f32>(&shape, None, None, &random::key(seed + k)?)?;
            let values = random::normal::<f32>(&shape, None, None, &random::key(seed + k + 1)?)?;
            Ok((keys, values))
        };
        let info = TargetInfo {
            model_type: "synthetic".into(),
            vocab_size,
            hidden_size,
            num_layers,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim,
            global_head_dim,
            // One sliding and one full donor layer, then the rest.
            layer_kinds: (0..num_layers)
                .map(|i| if i % 2 == 0 { LayerKind::SLIDING } else { LayerKind::FULL })
                .collect(),
            first_kv_shared_layer: num_layers,
            sliding_window,
            dtype: Dtype::Float32 as u32,
            final_logit_softcap: 0.0,
        };
        Ok(SyntheticTarget {
            info,
            embedding,
            sliding: kv(head_dim, 10)?,
            full: kv(global_head_dim, 20)?,
            rows: Rc::default(),
        })
    }

    /// The same target with a final softcap on its head (0 for none).
    pub fn with_softcap(mut self, cap: f32) -> Self {
        self.info.final_logit_softcap = cap;
        self
    }

    /// A view for a group of `rows` rows, which the caller keeps current.
    pub fn view_for(&self, rows: Rc<Cell<usize>>) -> TargetViewBox {
        TargetViewAbi_TO::from_value(SyntheticTarget { rows, ..self.clone() }, TD_Opaque)
    }

    pub fn view(&self) -> TargetViewBox {
        self.view_for(Rc::new(Cell::new(0)))
    }

    pub fn info(&self) -> &TargetInfo {
        &self.info
    }
}

impl TargetViewAbi for SyntheticTarget {
    fn info(&self) -> TargetInfo {
        self.info.clone()
    }

    fn embed(&self, ids: ArrayRef<'_>, scaled: bool) -> RResult<OwnedArray, PluginError> {
        let scale = if scaled { (self.info.hidden_size as f32).sqrt() } else { 1.0 };
        let result = self.embedding.take_axis(ids.to_array(), 0).and_then(|e| e.multiply(Array::from_f32(scale)));
        result.map(OwnedArray::new).map_err(PluginError::from).into()
    }

    fn logits_from_hidden(&self, hidden: ArrayRef<'_>) -> RResult<OwnedArray, PluginError> {
        let cap = self.info.final_logit_softcap;
        let logits = hidden.to_array().matmul(self.embedding.t()).and_then(|l| {
            if cap > 0.0 {
                crate::nn::ops::softcap(&l, cap)
            } else {
                Ok(l)
            }
        });
        logits.map(OwnedArray::new).map_err(PluginError::from).into()
    }

    fn extension(&self, _id: abi_stable::std_types::RStr<'_>) -> abi_stable::std_types::ROption<crate::abi::Extension> {
        abi_stable::std_types::ROption::RNone
    }

    fn read_donors(&self) -> RResult<Donors, PluginError> {
        let rows = self.rows.get() as i32;
        let layer = |(keys, values): &(Array, Array), window: u32| -> Result<DonorLayer, PluginError> {
            let shape = |a: &Array| [rows, a.shape()[1], a.shape()[2], a.shape()[3]];
            let positions: Vec<i32> = (0..rows).flat_map(|_| 0..DONOR_SLOTS).collect();
            Ok(DonorLayer {
                keys: OwnedArray::new(broadcast_to(keys, &shape(keys))?),
                values: OwnedArray::new(broadcast_to(values, &shape(values))?),
                slot_positions: OwnedArray::new(Array::from_slice(&positions, &[rows, DONOR_SLOTS])),
                window,
            })
        };
        let donors = (|| {
            Ok(Donors {
                positions: vec![DONOR_SLOTS - 1; rows as usize].into(),
                sliding: layer(&self.sliding, self.info.sliding_window)?,
                full: layer(&self.full, 0)?,
            })
        })();
        donors.into()
    }
}

/// What the kit runs.
#[derive(Debug, Clone)]
pub struct Config {
    pub artifact: Option<PathBuf>,
    /// The drafter's options, as TOML text.
    pub options: String,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
    /// The target head's final softcap; 0 for none.
    pub final_logit_softcap: f32,
    /// Head dims of the target's sliding and full layers, and its sliding window.
    pub head_dim: u32,
    pub global_head_dim: u32,
    pub sliding_window: u32,
    pub rows: usize,
    pub prompt_len: usize,
    pub depth: usize,
    pub rounds: usize,
    pub seed: u64,
}

impl Config {
    /// A synthetic target of the repository's demo target's shape (models/kjv-gemma4: vocab
    /// 8192, hidden 256, six layers, head dims 64 and 128, window 128, softcap 30), for a
    /// drafter trained for it (`artifact`).
    pub fn demo_target(artifact: PathBuf) -> Config {
        Config {
            artifact: Some(artifact),
            vocab_size: 8192,
            hidden_size: 256,
            num_layers: 6,
            final_logit_softcap: 30.0,
            head_dim: 64,
            global_head_dim: 128,
            sliding_window: 128,
            ..Config::default()
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            artifact: None,
            options: String::new(),
            vocab_size: 64,
            hidden_size: 16,
            num_layers: 4,
            final_logit_softcap: 0.0,
            head_dim: 8,
            global_head_dim: 8,
            sliding_window: 8,
            rows: 3,
            prompt_len: 24,
            depth: 4,
            rounds: 8,
            seed: 1,
        }
    }
}

/// Each named check and its outcome.
#[derive(Debug, Default)]
pub struct Report {
    pub checks: Vec<(String, Result<(), String>)>,
    /// Tokens proposed over all rounds and rows: a drafter that never proposes passes the
    /// contract but exercises little of it.
    pub drafted: usize,
    /// Nodes of the trees proposed (`draft-tree/1`), over all rounds and rows.
    pub tree_nodes: usize,
}

impl Report {
    fn record(&mut self, name: &str, outcome: Result<(), String>) -> bool {
        let ok = outcome.is_ok();
        self.checks.push((name.to_owned(), outcome));
        ok
    }

    pub fn failures(&self) -> Vec<&(String, Result<(), String>)> {
        self.checks.iter().filter(|(_, r)| r.is_err()).collect()
    }

    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.failures().is_empty()
    }

    /// Panics with every failed check, for use in tests.
    pub fn assert_passed(&self) {
        assert!(self.passed(), "conformance failed:\n{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, outcome) in &self.checks {
            match outcome {
                Ok(()) => writeln!(f, "ok    {name}")?,
                Err(why) => writeln!(f, "FAIL  {name}: {why}")?,
            }
        }
        Ok(())
    }
}

/// Runs the kit on drafter `D` in this process, through its exported root module.
pub fn check<D: sdk::Drafter>(config: &Config) -> Report {
    check_root(sdk::root_module::<D>(), config)
}

/// Runs the kit on a root module, e.g. one the host loaded from a library.
pub fn check_root(root: DrafterRootRef, config: &Config) -> Report {
    let mut report = Report::default();
    let _ = run(root, config, &mut report);
    report
}

/// A deterministic xorshift stream, so every run of the kit drives the same inputs.
struct Stream(u64);

impl Stream {
    fn next(&mut self, below: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % u64::from(below.max(1))) as u32
    }
}

fn err(e: PluginError) -> String {
    e.to_string()
}

fn run(root: DrafterRootRef, config: &Config, report: &mut Report) -> Option<()> {
    let descriptor = (root.descriptor())().into_result();
    let descriptor_ok = descriptor.as_ref().map_err(|e| err(e.clone())).and_then(|d| {
        if d.kind.is_empty() || d.version.is_empty() {
            Err("kind and version must not be empty".into())
        } else {
            Ok(())
        }
    });
    if !report.record("descriptor", descriptor_ok) {
        return None;
    }
    let artifact = config.artifact.as_ref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let provider = (root.load())(artifact.as_str().into(), config.options.as_str().into()).into_result();
    if !report.record("load", provider.as_ref().map(|_| ()).map_err(|e| err(e.clone()))) {
        return None;
    }
    let provider = provider.ok()?;
    let info = provider.info();
    report.record("info", check_info(&info, config));

    let target = SyntheticTarget::with_heads(
        config.vocab_size,
        config.hidden_size,
        config.num_layers,
        config.head_dim,
        config.global_head_dim,
        config.sliding_window,
        config.seed,
    )
    .map(|t| t.with_softcap(config.final_logit_softcap));
    let target = match target {
        Ok(t) => t,
        Err(e) => {
            report.record("synthetic target", Err(err(e)));
            return None;
        }
    };
    let (rows_a, rows_b) = (Rc::new(Cell::new(config.rows)), Rc::new(Cell::new(config.rows)));
    let open = |rows: &Rc<Cell<usize>>| {
        provider.open(target.view_for(rows.clone()), rows.get() as u32).into_result().map_err(err)
    };
    let (mut a, mut b) = match (open(&rows_a), open(&rows_b)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            report.record("open", Err(e));
            return None;
        }
    };
    report.record("open", Ok(()));

    let taps = info.capabilities.tap_layers.len().max(1) * config.hidden_size as usize;
    let mut stream = Stream(config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    // A small alphabet makes repetitions, so that lookup-style drafters have something to find.
    let alphabet = config.vocab_size.min(8);
    let prompt: Vec<u32> = (0..config.rows * config.prompt_len).map(|_| stream.next(alphabet)).collect();
    let prefix_len = config.prompt_len - 1;
    let prefix: Vec<u32> =
        (0..config.rows).flat_map(|r| prompt[r * config.prompt_len..][..prefix_len].to_vec()).collect();
    let mut pending: Vec<u32> = (0..config.rows).map(|r| prompt[r * config.prompt_len + prefix_len]).collect();

    // The context: tapped hidden states, or final hidden states when the drafter taps none.
    let context = |rows: usize, len: usize, key: u64| -> Option<Array> {
        random::normal::<f32>(&[rows as i32, len as i32, taps as i32], None, None, &random::key(key).ok()?).ok()
    };
    let prefill_context = context(config.rows, prefix_len, config.seed + 1);
    let prefill = |g: &mut RowGroupBox| {
        g.prefill(TokenRows::new(&prefix, config.rows), prefill_context.as_ref().map(ArrayRef::new).into())
            .into_result()
            .map_err(err)
    };
    if !info.capabilities.tap_layers.is_empty() && prefix_len > 1 {
        // A drafter that reads tapped states must refuse states that do not cover its tokens.
        let short = context(config.rows, prefix_len - 1, config.seed + 2);
        let refused = open(&rows_a).and_then(|mut c| {
            match c
                .prefill(TokenRows::new(&prefix, config.rows), short.as_ref().map(ArrayRef::new).into())
                .into_result()
            {
                Err(e) if e.kind != crate::ErrorKind::PANICKED => Ok(()),
                Err(e) => Err(format!("panicked instead of refusing: {e}")),
                Ok(()) => Err(format!("accepted {prefix_len} tokens with tapped states for {}", prefix_len - 1)),
            }
        });
        report.record("prefill refuses a context that does not cover the tokens", refused);
    }
    let prefilled = prefill(&mut a).and_then(|_| prefill(&mut b));
    if !report.record("prefill", prefilled) {
        return None;
    }

    let device_draft = match extension_table::<DeviceDraft>(root, DEVICE_DRAFT_ID) {
        Ok(table) => table,
        Err(e) => {
            report.record("device-draft/1 extension", Err(e));
            None
        }
    };
    let draft_tree = match extension_table::<DraftTree>(root, DRAFT_TREE_ID) {
        Ok(table) => table,
        Err(e) => {
            report.record("draft-tree/1 extension", Err(e));
            None
        }
    };
    let mut step = prefix_len as u64;
    for round in 0..config.rounds {
        let depth = 1 + round % config.depth.max(1);
        let steps = vec![step; config.rows];
        // Trees first, from b alone: b's chains then show that drafting a tree left its
        // committed state as it was.
        let mut trees = None;
        if let Some(table) = &draft_tree {
            let nodes = 2 * depth;
            let mut ask = || {
                let answer = (table.draft)(
                    &mut b,
                    pending.as_slice().into(),
                    depth as u32,
                    nodes as u32,
                    steps.as_slice().into(),
                );
                answer.into_result().map_err(err).map(|t| t.into_option().map(plain_trees))
            };
            let checked = ask().and_then(|first| {
                let again = ask()?;
                check_trees(first.as_ref(), again.as_ref(), config.rows, depth, nodes, config.vocab_size)?;
                Ok(first)
            });
            match checked {
                Ok(t) => trees = t,
                Err(e) => {
                    report.record(&format!("draft trees (round {round})"), Err(e));
                    return None;
                }
            }
            report.record(&format!("draft trees (round {round})"), Ok(()));
        }
        let drafted_a = a.draft(pending.as_slice().into(), depth as u32, steps.as_slice().into()).into_result();
        let drafted_b = b.draft(pending.as_slice().into(), depth as u32, steps.as_slice().into()).into_result();
        let (drafted_a, drafted_b) = match (drafted_a, drafted_b) {
            (Ok(x), Ok(y)) => (x, y),
            (Err(e), _) | (_, Err(e)) => {
                report.record(&format!("draft (round {round})"), Err(err(e)));
                return None;
            }
        };
        let valid = check_draft(&drafted_a, config.rows, depth, config.vocab_size);
        if !report.record(&format!("draft answer (round {round})"), valid) {
            return None;
        }
        let same = token_lists(&drafted_a) == token_lists(&drafted_b);
        report.record(
            &format!("determinism (round {round})"),
            if same {
                Ok(())
            } else {
                Err(format!("{:?} then {:?} for the same inputs", token_lists(&drafted_a), token_lists(&drafted_b)))
            },
        );

        if let Some(table) = &device_draft {
            let answer = (table.draft)(&mut b, pending.as_slice().into(), depth as u32, steps.as_slice().into());
            let checked =
                answer.into_result().map_err(err).and_then(|t| check_device_drafts(t.into_option(), &drafted_a, depth));
            report.record(&format!("drafts on the device (round {round})"), checked);
        }

        // Simulate verification: accept a random prefix of each row's draft, then a new token;
        // in every other round with trees, a random path of each row's tree, as the host
        // commits a tree.
        let mut drafts = token_lists(&drafted_a);
        report.drafted += drafts.iter().map(Vec::len).sum::<usize>();
        if let Some(trees) = trees.filter(|_| round % 2 == 1) {
            report.tree_nodes += trees.iter().map(|(t, _)| t.len()).sum::<usize>();
            drafts = trees
                .iter()
                .map(|(t, _)| {
                    let leaf = stream.next(t.len() as u32 + 1) as usize;
                    if leaf == 0 {
                        Vec::new()
                    } else {
                        t.path_to(leaf - 1).iter().map(|&i| t.tokens[i]).collect()
                    }
                })
                .collect();
        }
        let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let mut window = Vec::with_capacity(config.rows * width);
        let mut accepted = Vec::with_capacity(config.rows);
        for (r, d) in drafts.iter().enumerate() {
            window.push(pending[r]);
            window.extend_from_slice(d);
            window.extend(std::iter::repeat_n(0, width - 1 - d.len()));
            accepted.push(stream.next(d.len() as u32 + 1));
        }
        let commit_context = context(config.rows, width, config.seed + 10 + round as u64);
        let commit = |g: &mut RowGroupBox| {
            g.commit(
                TokenRows::new(&window, config.rows),
                accepted.as_slice().into(),
                commit_context.as_ref().map(ArrayRef::new).into(),
            )
            .into_result()
            .map_err(err)
        };
        if !report.record(&format!("commit (round {round})"), commit(&mut a).and_then(|_| commit(&mut b))) {
            return None;
        }
        pending = (0..config.rows).map(|_| stream.next(alphabet)).collect();
        step += 1 + accepted.iter().copied().max().unwrap_or(0) as u64;
    }

    report.record(
        "capture and append",
        check_capture_append(&provider_open(&provider, &target), &mut a, &pending, config, step),
    );
    report.record("filter rows", check_filter(&mut a, &mut b, &pending, config, step));
    Some(())
}

/// The plugin's table of extension `id`, if it offers one with the right layout.
fn extension_table<T: abi_stable::StableAbi>(root: DrafterRootRef, id: &str) -> Result<Option<&'static T>, String> {
    crate::extension::find(root, id)
        .map_err(|report| format!("its layout differs from this crate's: {}", report.lines().next().unwrap_or("")))
}

/// Trees as the ABI carries them, in plain Rust.
fn plain_trees(rows: RVec<TreeRow>) -> Vec<(Tree, Option<Array>)> {
    rows.into_iter()
        .map(|row| {
            let (tree, p) = row.into();
            (tree, p.map(OwnedArray::into_array))
        })
        .collect()
}

/// Every row's tree keeps the rules ([`Tree::check`]), its probabilities (if any) are [nodes,
/// V], and the same inputs gave the same trees. None answered is legal, but not once of two.
fn check_trees(
    first: Option<&Vec<(Tree, Option<Array>)>>,
    again: Option<&Vec<(Tree, Option<Array>)>>,
    rows: usize,
    depth: usize,
    nodes: usize,
    vocab: u32,
) -> Result<(), String> {
    let (first, again) = match (first, again) {
        (None, None) => return Ok(()),
        (Some(first), Some(again)) => (first, again),
        _ => return Err("a tree once, none the second time for the same inputs".into()),
    };
    if first.len() != rows {
        return Err(format!("{} trees for {rows} rows", first.len()));
    }
    for (r, (tree, p)) in first.iter().enumerate() {
        tree.check(depth, nodes, vocab).map_err(|e| format!("row {r}: {e}"))?;
        if let Some(p) = p {
            if p.shape() != [tree.len() as i32, vocab as i32] {
                return Err(format!("row {r}: probabilities of shape {:?} for {} nodes", p.shape(), tree.len()));
            }
        }
    }
    let trees = |t: &Vec<(Tree, Option<Array>)>| t.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
    if trees(first) != trees(again) {
        return Err(format!("{:?} then {:?} for the same inputs", trees(first), trees(again)));
    }
    Ok(())
}

/// Device drafts, where a group gave them, are `draft`'s tokens: every row's `depth` of them.
fn check_device_drafts(tokens: Option<OwnedArray>, drafted: &RVec<DraftRow>, depth: usize) -> Result<(), String> {
    let Some(tokens) = tokens.map(OwnedArray::into_array) else { return Ok(()) };
    let want = [drafted.len() as i32, depth as i32];
    if tokens.shape() != want || !matches!(tokens.dtype(), Dtype::Int32 | Dtype::Uint32) {
        return Err(format!(
            "tokens {:?} of shape {:?}, expected int32 or uint32 {want:?}",
            tokens.dtype(),
            tokens.shape()
        ));
    }
    let on_device = tokens.as_dtype(Dtype::Uint32).map_err(|e| e.to_string())?;
    let on_device: Vec<Vec<u32>> = on_device.as_slice::<u32>().chunks(depth).map(<[u32]>::to_vec).collect();
    let on_host = token_lists(drafted);
    if on_device != on_host {
        return Err(format!("{on_device:?} on the device, {on_host:?} from draft"));
    }
    Ok(())
}

/// Opens a group whose view lends donors to as many rows as the group has.
fn provider_open<'a>(
    provider: &'a crate::abi::ProviderBox,
    target: &'a SyntheticTarget,
) -> impl Fn(&Rc<Cell<usize>>) -> Result<RowGroupBox, String> + 'a {
    move |rows| provider.open(target.view_for(rows.clone()), rows.get() as u32).into_result().map_err(err)
}

fn check_info(info: &ProviderInfo, config: &Config) -> Result<(), String> {
    if let Some(bad) = info.capabilities.tap_layers.iter().find(|&&l| l > config.num_layers) {
        return Err(format!("tap layer {bad} beyond the target's {} layers", config.num_layers));
    }
    if info.namespace.is_empty() {
        return Err("empty namespace".into());
    }
    Ok(())
}

fn token_lists(rows: &RVec<DraftRow>) -> Vec<Vec<u32>> {
    rows.iter().map(|r| r.tokens.to_vec()).collect()
}

fn check_draft(rows: &RVec<DraftRow>, expected_rows: usize, depth: usize, vocab: u32) -> Result<(), String> {
    if rows.len() != expected_rows {
        return Err(format!("{} proposals for {expected_rows} rows", rows.len()));
    }
    for (r, row) in rows.iter().enumerate() {
        if row.tokens.len() > depth {
            return Err(format!("row {r}: {} tokens for depth {depth}", row.tokens.len()));
        }
        if let Some(bad) = row.tokens.iter().find(|&&t| t >= vocab) {
            return Err(format!("row {r}: token {bad} outside a vocabulary of {vocab}"));
        }
        if let RSome(p) = &row.probabilities {
            let p = p.borrow().to_array();
            if p.shape() != [row.tokens.len() as i32, vocab as i32] {
                return Err(format!("row {r}: probabilities of shape {:?}", p.shape()));
            }
        }
    }
    Ok(())
}

fn draft_tokens(g: &mut RowGroupBox, pending: &[u32], depth: usize, step: u64) -> Result<Vec<Vec<u32>>, String> {
    let steps = vec![step; pending.len()];
    g.draft(pending.into(), depth as u32, steps.as_slice().into())
        .into_result()
        .map(|rows| token_lists(&rows))
        .map_err(err)
}

/// A row captured from one group and appended to an empty one drafts as it did.
fn check_capture_append(
    open: &impl Fn(&Rc<Cell<usize>>) -> Result<RowGroupBox, String>,
    a: &mut RowGroupBox,
    pending: &[u32],
    config: &Config,
    step: u64,
) -> Result<(), String> {
    let row = config.rows - 1;
    let state: RowState = a.capture(row as u32).into_result().map_err(err)?;
    let fresh_rows = Rc::new(Cell::new(0));
    let mut fresh = open(&fresh_rows)?;
    fresh.append(vec![state].into()).into_result().map_err(err)?;
    fresh_rows.set(1);
    let restored = draft_tokens(&mut fresh, &pending[row..=row], config.depth, step)?;
    let original = draft_tokens(a, pending, config.depth, step)?;
    if restored[0] != original[row] {
        return Err(format!("restored row drafts {:?}, the original {:?}", restored[0], original[row]));
    }
    Ok(())
}

/// After keeping rows [last, 0], the group drafts what those rows drafted before.
fn check_filter(
    a: &mut RowGroupBox,
    b: &mut RowGroupBox,
    pending: &[u32],
    config: &Config,
    step: u64,
) -> Result<(), String> {
    let last = config.rows - 1;
    let before = draft_tokens(b, pending, config.depth, step)?;
    a.filter_rows([last as u32, 0].as_slice().into()).into_result().map_err(err)?;
    let after = draft_tokens(a, &[pending[last], pending[0]], config.depth, step)?;
    if after != vec![before[last].clone(), before[0].clone()] {
        return Err(format!("after filtering: {after:?}, before: {:?}", [&before[last], &before[0]]));
    }
    Ok(())
}
