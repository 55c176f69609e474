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

/// The length of [`encode`]'s bytes for `v`, counted without building them
/// (issue 38: measuring a run record for trimming allocated and copied it
/// whole at each attempt's end).
///
/// Errors: [`Error::Internal`] if the value cannot be serialized (a bug).
pub fn encoded_len<T: Serialize + ?Sized>(v: &T) -> Result<usize> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    serde_json::to_writer(&mut c, v).map_err(|e| Error::Internal(format!("cannot encode a stored value: {e}")))?;
    Ok(c.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn encoded_len_is_the_length_of_the_encoding() {
        let v = serde_json::json!({"a": [1, 2, "x\"y"], "b": {"c": null}, "ü": 1.5});
        assert_eq!(super::encoded_len(&v).expect("len"), super::encode(&v).expect("encode").len());
    }
}
