//! What models are told about a declared MCP tool: its spec while its server lists it,
//! nothing otherwise.
//!
//! The agent loop borrows each offered spec from the tool registry for the length of a
//! task, so a spec, once offered, is never replaced in place: a changed `inputSchema`
//! is added as a new version (at most [`MAX_SPEC_VERSIONS`] per tool over the worker's
//! life; past that, models keep the last one until the worker restarts, and the server
//! still validates the arguments it gets).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use super::CatalogEntry;
use crate::provider::ToolSpec;
use crate::tools::with_kind_arg;

/// Specs one tool may go through over the worker's life.
pub const MAX_SPEC_VERSIONS: usize = 16;

/// A declared MCP tool's spec as models see it.
#[derive(Debug)]
pub(crate) struct Offer {
    /// The catalog's entry.
    pub(crate) entry: CatalogEntry,
    /// The specs offered so far, oldest first; the last filled one is current.
    versions: Vec<OnceLock<Arc<ToolSpec>>>,
    /// How many of `versions` are filled.
    filled: AtomicUsize,
    /// Whether the server's last listing names the tool.
    listed: AtomicBool,
}

impl Offer {
    pub(crate) fn new(entry: CatalogEntry) -> Self {
        Self {
            entry,
            versions: (0..MAX_SPEC_VERSIONS).map(|_| OnceLock::new()).collect(),
            filled: AtomicUsize::new(0),
            listed: AtomicBool::new(false),
        }
    }

    /// The spec models are offered, or `None` while the server does not list the tool.
    pub(crate) fn model_spec(&self) -> Option<&Arc<ToolSpec>> {
        if !self.listed.load(Ordering::Acquire) {
            return None;
        }
        self.current()
    }

    fn current(&self) -> Option<&Arc<ToolSpec>> {
        let filled = self.filled.load(Ordering::Acquire);
        filled.checked_sub(1).and_then(|i| self.versions[i].get())
    }

    /// The server lists the tool as `tool`: offer it with that schema. Callers
    /// serialize calls (the listing's lock).
    pub(crate) fn list(&self, tool: &rmcp::model::Tool) {
        let spec = with_kind_arg(self.spec_of(tool));
        let changed = self.current().is_none_or(|current| **current != spec);
        if changed {
            let filled = self.filled.load(Ordering::Acquire);
            match self.versions.get(filled) {
                Some(slot) => {
                    let _ = slot.set(Arc::new(spec));
                    self.filled.store(filled + 1, Ordering::Release);
                }
                None => tracing::warn!(
                    tool = %self.entry.name,
                    "the MCP server changed this tool's schema {MAX_SPEC_VERSIONS} times; \
                     models keep the last one offered until the worker restarts"
                ),
            }
        }
        self.listed.store(true, Ordering::Release);
    }

    /// The server no longer lists the tool: offer it no more.
    pub(crate) fn withdraw(&self) {
        self.listed.store(false, Ordering::Release);
    }

    /// The spec of the tool as the server lists it: its `inputSchema` as parameters, the
    /// catalog's description (the server's when the catalog has none).
    fn spec_of(&self, tool: &rmcp::model::Tool) -> ToolSpec {
        let description = if self.entry.description.trim().is_empty() {
            tool.description
                .as_deref()
                .map(str::to_owned)
                .unwrap_or_else(|| {
                    format!(
                        "Tool {} of MCP server {}.",
                        self.entry.tool, self.entry.server
                    )
                })
        } else {
            self.entry.description.clone()
        };
        ToolSpec {
            name: self.entry.name.clone(),
            description,
            parameters: Value::Object((*tool.input_schema).clone()),
        }
    }

    /// The spec before the server has listed the tool: the catalog's description and an
    /// open object schema.
    pub(crate) fn placeholder(&self) -> ToolSpec {
        ToolSpec {
            name: self.entry.name.clone(),
            description: self.entry.description.clone(),
            parameters: serde_json::json!({ "type": "object", "properties": {} }),
        }
    }
}
