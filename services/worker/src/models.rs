//! How a worker drives its model providers: the `CONVENE_MODEL` override, retries of
//! failed model calls, the HTTP request timeout, prices for cost accounting, and
//! whether prompts and completions may go into spans.
//!
//! In a worker's configuration file this is the `models` section (plus the top-level
//! `model` key); `convene up` and `convene run --local` use the defaults with
//! `CONVENE_MODEL` applied.
//!
//! ```toml
//! [models]
//! retries = 4
//! backoff = "500ms"
//! request_timeout = "10m"
//!
//! [models.prices."gpt-4o-mini"]
//! input_per_1k = 0.00015
//! output_per_1k = 0.0006
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::openai::{ClientSettings, DEFAULT_REQUEST_TIMEOUT};
use crate::provider::TokenUsage;

/// The variable that, when set, overrides `model` in every profile whose provider is
/// `openai`. It is on the services' reserved list (`convene_server::config`), so every
/// service binary starts with it set; the worker reads it itself.
pub const MODEL_ENV: &str = "CONVENE_MODEL";
/// Default retries of a model call that failed transiently.
pub const DEFAULT_RETRIES: u32 = 4;
/// Default first pause between retries; it doubles each time, with jitter.
pub const DEFAULT_BACKOFF: Duration = Duration::from_millis(500);
/// Longest pause between retries, unless the server asks for longer (`Retry-After`).
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The price of one model's tokens, in the deployment's accounting unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Per 1,000 input (prompt) tokens.
    #[serde(default)]
    pub input_per_1k: f64,
    /// Per 1,000 output (completion) tokens.
    #[serde(default)]
    pub output_per_1k: f64,
}

impl Price {
    /// What `usage` costs at this price.
    pub fn cost(&self, usage: TokenUsage) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let (input, output) = (usage.input as f64, usage.output as f64);
        input / 1000.0 * self.input_per_1k + output / 1000.0 * self.output_per_1k
    }
}

/// The worker's model settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSettings {
    /// Retries of a model call that failed transiently (429, 5xx, a broken connection,
    /// a timeout) before the task fails as retryable.
    pub retries: u32,
    /// First pause between retries; doubled each time up to 30 s, with jitter. A
    /// server's `Retry-After` is honoured when it asks for longer.
    #[serde(with = "convene_server::config::duration")]
    pub backoff: Duration,
    /// Time one HTTP request to a model server may take.
    #[serde(with = "convene_server::config::duration")]
    pub request_timeout: Duration,
    /// Token prices by model name (the name the server reports, else the profile's);
    /// a model without a price costs nothing.
    pub prices: BTreeMap<String, Price>,
    /// Whether `model.call` spans carry the prompt and the completion
    /// (`gen_ai.input.messages`, `gen_ai.output.messages`). Off by default: they may
    /// hold data the trace backend should not see.
    pub record_content: bool,
}

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            retries: DEFAULT_RETRIES,
            backoff: DEFAULT_BACKOFF,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            prices: BTreeMap::new(),
            record_content: false,
        }
    }
}

impl ModelSettings {
    /// The HTTP client settings the `openai` provider uses.
    pub fn client(&self) -> ClientSettings {
        ClientSettings {
            request_timeout: self.request_timeout,
        }
    }

    /// The cost of `usage` on `model` (0 without a price).
    pub fn cost(&self, model: &str, usage: TokenUsage) -> f64 {
        self.prices.get(model).map_or(0.0, |p| p.cost(usage))
    }

    /// The pause before retry `n` (from 1): the backoff doubled `n - 1` times, capped,
    /// with up to half of it taken off at random, and never shorter than what the
    /// server asked for.
    pub fn pause(&self, n: u32, retry_after: Option<Duration>) -> Duration {
        let doubled = self
            .backoff
            .saturating_mul(1_u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX))
            .min(MAX_BACKOFF.max(self.backoff));
        let jitter = doubled.mul_f64(jitter_fraction() / 2.0);
        let pause = doubled.saturating_sub(jitter);
        retry_after.map_or(pause, |asked| asked.max(pause))
    }

    /// Checks the settings; the message names the key.
    ///
    /// # Errors
    ///
    /// A zero request timeout, or a negative or non-finite price.
    pub fn validate(&self) -> Result<(), String> {
        if self.request_timeout.is_zero() {
            return Err("models.request_timeout must be longer than 0, e.g. \"10m\"".into());
        }
        for (model, price) in &self.prices {
            for (key, v) in [
                ("input_per_1k", price.input_per_1k),
                ("output_per_1k", price.output_per_1k),
            ] {
                if !v.is_finite() || v < 0.0 {
                    return Err(format!(
                        "models.prices.{model:?}.{key} is {v}; give a price of 0 or more"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A fraction in `[0, 1)` that differs between calls, for jitter (not for secrets).
fn jitter_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    #[allow(clippy::cast_precision_loss)]
    let fraction = (h.finish() >> 11) as f64 / (1_u64 << 53) as f64;
    fraction
}

/// The `CONVENE_MODEL` override from the environment, if set and not empty.
pub fn model_from_env() -> Option<String> {
    std::env::var(MODEL_ENV)
        .ok()
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_with_jitter_and_honour_retry_after() {
        let s = ModelSettings {
            backoff: Duration::from_millis(100),
            ..ModelSettings::default()
        };
        for n in 1..=4 {
            let full = Duration::from_millis(100 * (1 << (n - 1)));
            let p = s.pause(n, None);
            assert!(p <= full && p >= full / 2, "retry {n}: {p:?}");
        }
        assert!(s.pause(40, None) <= MAX_BACKOFF);
        assert_eq!(
            s.pause(1, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn cost_uses_the_model_price() {
        let mut s = ModelSettings::default();
        s.prices.insert(
            "m".into(),
            Price {
                input_per_1k: 1.0,
                output_per_1k: 2.0,
            },
        );
        let usage = TokenUsage {
            input: 500,
            output: 250,
        };
        assert!((s.cost("m", usage) - 1.0).abs() < 1e-9);
        assert!(s.cost("other", usage).abs() < 1e-12);
        s.prices.get_mut("m").unwrap().input_per_1k = -1.0;
        assert!(s.validate().unwrap_err().contains("input_per_1k"));
    }
}
