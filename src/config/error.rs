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
    /// `origin` names the file, or says there was none.
    #[error("{origin} is not valid: {message}")]
    Parse { origin: String, message: String },
    /// A required key that neither the file nor the environment nor `--set` gave.
    #[error(
        "{key} is required: set it in the config file, as {env_name}, or with --set {key}=… ({origin})"
    )]
    Missing {
        key: &'static str,
        env_name: &'static str,
        origin: String,
    },
    #[error("environment variable {name} is not valid: {message}")]
    Env { name: String, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// A table name that is not `schema.table`.
    #[error("invalid configuration: {0}")]
    TableName(#[from] super::TableNameError),
}
