//! Proposes the tokens that followed the last occurrence of the row's last token, one after
//! another: a drafter written against `plugin-api` alone, outside the host's workspace.

use std::path::Path;

use plugin_api::sdk::lookup::{FromText, TextRow};
use plugin_api::sdk::{DraftProvider, Drafter, Options, SourceRows, Target};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

pub struct Bigram;

const NAMESPACE: &str = "bigram/1";

impl Drafter for Bigram {
    type Provider = BigramProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("bigram", "bigram lookup", env!("CARGO_PKG_VERSION"))
            .summary("proposes what followed the row's last token when it last occurred")
    }

    fn load(_artifact: Option<&Path>, _options: &Options) -> Result<BigramProvider, PluginError> {
        Ok(BigramProvider)
    }
}

pub struct BigramProvider;

#[derive(Clone, Copy)]
pub struct Follow;

impl DraftProvider for BigramProvider {
    type Rows = SourceRows<TextRow<Follow>>;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "bigram".into(),
            weights_bytes: 0,
            namespace: NAMESPACE.into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }

    fn open(&self, _target: Target, rows: usize) -> Result<Self::Rows, PluginError> {
        Ok(SourceRows::new(Follow, TextRow::default(), rows, NAMESPACE))
    }
}

impl FromText for Follow {
    fn draft(&self, text: &[u32], depth: usize) -> Vec<u32> {
        let mut drafted = Vec::new();
        let Some(&(mut last)) = text.last() else { return drafted };
        while drafted.len() < depth {
            // The latest pair of tokens whose first is `last`.
            let Some(pair) = text.windows(2).rev().find(|pair| pair[0] == last) else { break };
            drafted.push(pair[1]);
            last = pair[1];
        }
        drafted
    }
}

plugin_api::export_drafter!(Bigram);

#[cfg(test)]
mod tests {
    use plugin_api::conformance::{check, Config};

    #[test]
    fn passes_the_conformance_kit() {
        check::<super::Bigram>(&Config::default()).assert_passed();
    }
}
