use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    /// A txn compare did not hold; nothing was written.
    #[error("conflict on key {key:?}: a txn compare did not hold")]
    Conflict { key: String },

    /// The backend cannot be reached (etcd down or too slow). For a write this
    /// means its outcome is unknown: read back before retrying blindly.
    #[error("store unavailable: {0}")]
    Unavailable(String),

    /// Stored data does not decode (bad record, non-UTF-8 key from elsewhere).
    #[error("store data corrupt: {0}")]
    Corrupt(String),

    /// A local I/O or backend failure that is neither of the above.
    #[error("store I/O error: {0}")]
    Io(String),

    /// The caller passed a key the store refuses (empty, too long, control
    /// characters, written twice in one txn).
    #[error("invalid key: {0}")]
    InvalidKey(String),

    /// The backend refused the request as over one of its limits (etcd: too
    /// many txn ops, request too large).
    #[error("request rejected by the store: {0}")]
    Rejected(String),
}

impl StoreError {
    pub fn is_conflict(&self) -> bool {
        matches!(self, StoreError::Conflict { .. })
    }
}
