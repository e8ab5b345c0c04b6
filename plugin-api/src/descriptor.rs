//! What a plugin says about itself before anything is loaded, and about an artifact after.

use abi_stable::std_types::{RString, RVec};
use abi_stable::StableAbi;

/// Which target ports a drafter needs; the host refuses a pairing that lacks one.
/// **ABI-frozen** (a `u32` bitset; new bits may be added).
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Ports(pub u32);

impl Ports {
    pub const NONE: Self = Self(0);
    /// `TargetView::embed`: the target's token embedding, scaled or not.
    pub const EMBED: Self = Self(1);
    /// `TargetView::logits_from_hidden`: the target's head with its softcap.
    pub const LOGITS: Self = Self(1 << 1);
    /// `TargetView::read_donors`: the K/V of the last sliding and last full donor layers.
    pub const DONORS: Self = Self(1 << 2);
    /// Hidden states of the target at `tap_layers` (or its final hidden states), as `context`
    /// in prefill and commit.
    pub const TAPS: Self = Self(1 << 3);

    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
    /// Names of the set bits, for messages and `host plugins inspect`.
    pub fn names(self) -> Vec<&'static str> {
        [(Self::EMBED, "embed"), (Self::LOGITS, "logits"), (Self::DONORS, "donors"), (Self::TAPS, "taps")]
            .into_iter()
            .filter(|(port, _)| self.contains(*port))
            .map(|(_, name)| name)
            .collect()
    }
}

/// How the prompt reaches the drafter. **ABI-frozen** (a `u8`). Hosts serve `TAIL_SPLIT`
/// only; another value is refused when the drafter is opened.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Debug)]
pub struct PrefillMode(pub u8);

impl PrefillMode {
    /// All prompt tokens but the last are prefilled; the last is the first round's pending
    /// token (mlx-lm's convention).
    pub const TAIL_SPLIT: Self = Self(0);

    pub fn name(self) -> String {
        match self {
            Self::TAIL_SPLIT => "tail-split".to_owned(),
            other => format!("unknown ({})", other.0),
        }
    }
}

/// What a drafter can do and needs. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct Capabilities {
    pub ports: Ports,
    /// Target layers whose hidden states the drafter reads (index = that layer's output;
    /// index = layer count = after the final norm), concatenated in this order on the feature
    /// axis. Empty: the final hidden states. In a [`Descriptor`] this may be empty when the
    /// artifact decides.
    pub tap_layers: RVec<u32>,
    pub prefill_mode: PrefillMode,
    /// The most tokens one draft call returns per row; 0 = no limit of its own.
    pub max_draft_tokens: u32,
    /// Whether `draft` can return the probabilities it drew its tokens from, which enables
    /// rejection sampling.
    pub draft_probabilities: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            ports: Ports::NONE,
            tap_layers: RVec::new(),
            prefill_mode: PrefillMode::TAIL_SPLIT,
            max_draft_tokens: 0,
            draft_probabilities: false,
        }
    }
}

/// A manifest option the drafter accepts under `[drafter]`. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct OptionDoc {
    pub key: RString,
    /// The default as a manifest writes the value: `3`, `0.5`, `true`, `"none"`; text that is
    /// no TOML value (`none`) is that string.
    pub default: RString,
    pub doc: RString,
}

/// Who a plugin is, readable without loading an artifact. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct Descriptor {
    /// The manifest's `[drafter] kind`, by which the host finds the plugin (by convention the
    /// crate's name; `host new-drafter` makes them one).
    pub kind: RString,
    pub name: RString,
    /// The plugin's own semver version.
    pub version: RString,
    pub summary: RString,
    /// Whether `load` needs an artifact directory; a drafter without one is given none, and
    /// a manifest that names one for it is refused.
    pub needs_artifact: bool,
    pub capabilities: Capabilities,
    pub options: RVec<OptionDoc>,
}

impl Descriptor {
    /// A descriptor with no artifact, no options and default capabilities; refine it with the
    /// builder methods below.
    pub fn new(kind: &str, name: &str, version: &str) -> Self {
        Descriptor {
            kind: kind.into(),
            name: name.into(),
            version: version.into(),
            summary: RString::new(),
            needs_artifact: false,
            capabilities: Capabilities::default(),
            options: RVec::new(),
        }
    }
    pub fn summary(mut self, summary: &str) -> Self {
        self.summary = summary.into();
        self
    }
    pub fn needs_artifact(mut self) -> Self {
        self.needs_artifact = true;
        self
    }
    pub fn capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = capabilities;
        self
    }
    /// Declares a `[drafter]` option, its default as a manifest writes the value (`"3"`,
    /// `"true"`; a word such as `"none"` is taken as the string itself) and what it does.
    pub fn option(mut self, key: &str, default: &str, doc: &str) -> Self {
        self.options.push(OptionDoc { key: key.into(), default: default.into(), doc: doc.into() });
        self
    }
}

/// What a loaded artifact is. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ProviderInfo {
    /// A stable name of the artifact (e.g. its directory's name).
    pub id: RString,
    /// Bytes of weights the provider holds resident.
    pub weights_bytes: u64,
    /// Identity of the drafter state's meaning; states captured under another namespace are
    /// not interchangeable.
    pub namespace: RString,
    /// The draft length the artifact was trained for; 0 when it has none.
    pub trained_depth: u32,
    /// The descriptor's capabilities, made concrete for this artifact.
    pub capabilities: Capabilities,
}
