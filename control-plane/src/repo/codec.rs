//! How stored values are encoded: JSON documents of the model types (and
//! the election's member records). The only serde calls on stored bytes.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// Encodes a value for the store.
///
/// Errors: [`Error::Internal`] if the value cannot be serialized (a bug).
pub fn encode<T: Serialize + ?Sized>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Internal(format!("cannot encode a stored value: {e}")))
}

/// Decodes a stored value; `what` names it in the error (`task`, `run`).
///
/// Errors: [`Error::Internal`] naming `what` when the bytes do not decode.
pub fn decode<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Internal(format!("stored {what} unreadable: {e}")))
}
