//! Why a configuration could not be used (exit code 2).

/// Configuration could not be read or is invalid (exit code 2).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: String, message: String },
    #[error("environment variable {name} is not valid: {message}")]
    Env { name: String, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// A table name that is not `schema.table`.
    #[error("invalid configuration: {0}")]
    TableName(#[from] super::TableNameError),
}
