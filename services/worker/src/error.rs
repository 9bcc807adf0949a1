//! The worker's startup and serving errors.

use std::path::PathBuf;

use convene_mesh::handles::EndpointError;
use convene_server::ServeError;

use crate::profiles;
use crate::service::SetupError;

/// Why a worker cannot start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The profiles cannot be loaded.
    #[error(transparent)]
    Profiles(#[from] profiles::Error),
    /// The tools' data directory does not exist.
    #[error(
        "tool data directory {} not found; pass --tools-data DIR or set tools_data_dir \
         (CONVENE_TOOLS_DATA_DIR)",
        path.display()
    )]
    ToolsDataDir {
        /// The directory.
        path: PathBuf,
    },
    /// The service cannot be built from the profiles (unknown provider or tool).
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The `worker-pool` credential cannot be read.
    #[error(
        "cannot read the worker-pool credential from {}: {source}; set credential_file or \
         start the worker with the data directory the other services use (data_dir)",
        path.display()
    )]
    Credential {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// An endpoint of another service is not a URL.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The MCP tools cannot be mounted (the tool catalog cannot be read).
    #[error(transparent)]
    Mcp(#[from] crate::tools::mcp::McpError),
    /// The gRPC server failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
}
