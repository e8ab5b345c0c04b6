//! `/metrics` in Prometheus text: what the server did, for dashboards and alerts.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::generate::Stats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// `ok`, `cancelled` (the client left), `rejected` (bad input, auth, full queue) or `failed`.
    pub outcome: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<Outcome, Counter>,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub drafted_tokens: Counter,
    pub accepted_tokens: Counter,
    /// Tokens per target forward of each finished request (τ).
    pub tokens_per_round: Histogram,
    pub batch_size: Gauge,
    pub queue_depth: Gauge,
    pub prefix_cache_hits: Counter,
    /// Prompt tokens whose prefill a cached prefix saved.
    pub prefix_cache_tokens: Counter,
    pub prefix_cache_bytes: Gauge,
    /// What MLX holds alive: weights, the batch's caches and the prefix cache. It returns to
    /// its idle level once the batch is empty, however its rows ended.
    pub active_memory_bytes: Gauge,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
}

impl Metrics {
    pub fn new() -> Metrics {
        let latency =
            || Histogram::new([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]);
        let mut m = Metrics {
            registry: Registry::with_prefix("host"),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            drafted_tokens: Counter::default(),
            accepted_tokens: Counter::default(),
            tokens_per_round: Histogram::new([1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]),
            batch_size: Gauge::default(),
            queue_depth: Gauge::default(),
            prefix_cache_hits: Counter::default(),
            prefix_cache_tokens: Counter::default(),
            prefix_cache_bytes: Gauge::default(),
            active_memory_bytes: Gauge::default(),
            time_to_first_token: latency(),
            inter_token_latency: latency(),
        };
        let registry = &mut m.registry;
        registry.register("requests", "Requests by outcome", m.requests.clone());
        registry.register("prompt_tokens", "Prompt tokens of finished requests", m.prompt_tokens.clone());
        registry.register("generated_tokens", "Tokens generated", m.generated_tokens.clone());
        registry.register("drafted_tokens", "Tokens the drafter proposed", m.drafted_tokens.clone());
        registry.register("accepted_tokens", "Drafted tokens the target accepted", m.accepted_tokens.clone());
        registry.register(
            "tokens_per_round",
            "Tokens per target forward of each finished request (tau)",
            m.tokens_per_round.clone(),
        );
        registry.register("batch_size", "Rows in the running batch", m.batch_size.clone());
        registry.register("queue_depth", "Requests waiting to join the batch", m.queue_depth.clone());
        registry.register(
            "prefix_cache_hits",
            "Requests whose prompt extended a cached one",
            m.prefix_cache_hits.clone(),
        );
        registry.register(
            "prefix_cache_tokens",
            "Prompt tokens whose prefill the prefix cache saved",
            m.prefix_cache_tokens.clone(),
        );
        registry.register_with_unit(
            "prefix_cache",
            "Target caches the prefix cache holds",
            prometheus_client::registry::Unit::Bytes,
            m.prefix_cache_bytes.clone(),
        );
        registry.register_with_unit(
            "mlx_active_memory",
            "Arrays MLX holds alive: weights, caches, the prefix cache",
            prometheus_client::registry::Unit::Bytes,
            m.active_memory_bytes.clone(),
        );
        registry.register_with_unit(
            "time_to_first_token",
            "From request to its first token",
            prometheus_client::registry::Unit::Seconds,
            m.time_to_first_token.clone(),
        );
        registry.register_with_unit(
            "inter_token_latency",
            "Between consecutive tokens of a request",
            prometheus_client::registry::Unit::Seconds,
            m.inter_token_latency.clone(),
        );
        m
    }

    pub fn count(&self, outcome: &'static str) {
        self.requests.get_or_create(&Outcome { outcome }).inc();
    }

    /// A finished generation's token counts.
    pub fn finished(&self, stats: &Stats) {
        self.prompt_tokens.inc_by(stats.prompt_tokens as u64);
        self.generated_tokens.inc_by(stats.generated_tokens as u64);
        self.drafted_tokens.inc_by(stats.drafted as u64);
        self.accepted_tokens.inc_by(stats.accepted as u64);
        if stats.cached_prompt_tokens > 0 {
            self.prefix_cache_hits.inc();
            self.prefix_cache_tokens.inc_by(stats.cached_prompt_tokens as u64);
        }
        if stats.rounds > 0 {
            self.tokens_per_round.observe(stats.mean_accept_len);
        }
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
