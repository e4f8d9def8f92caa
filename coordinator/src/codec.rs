//! All binary encoding lives here: one format version byte, then bincode 2
//! (serde, standard config). Decoding is bounded by `limits::DECODE_BYTES_MAX`
//! so a hostile or damaged input cannot make us allocate without limit.
//!
//! Decoding dispatches on the version byte (docs/adr/0042-storage-engines.md):
//! `FORMAT_VERSION` decodes as the one layout of each type; any other
//! version is refused (`CodecError::Version`): a higher one was written by
//! a newer build, a lower one is a pre-release layout that no build reads.
//! A caller that reads stored state names what it read (`CodecError::named`).

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::limits::DECODE_BYTES_MAX;

/// The version of every value this build encodes, and the only one it
/// decodes. Bumped whenever an encoded type changes incompatibly; the
/// decoder of the previous version is not kept. 3: one layout per type
/// (the snapshot's earlier layouts, which version 2 shared, are not read).
/// 4: the snapshot carries the branches of each transaction (ADR 0046).
/// 5: a saga's record carries its deadline and why it was cancelled, and
/// its Start command the deadline (docs/sagas.md, "Cancel and deadline").
/// 6: a saga's step calls carry their output and who completed them, its
/// steps who approved their compensation, a definition's steps whether
/// they are high-impact; journal commands `Complete`, `AwaitApproval`
/// (docs/sagas.md, "Outputs, pending steps and approvals").
pub const FORMAT_VERSION: u8 = 6;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty input (no format version byte)")]
    Empty,
    /// Another format version: a newer build's, or a pre-release layout.
    #[error("{}", dtx_durable::format::describe((*found).into(), FORMAT_VERSION.into()))]
    Version { found: u8 },
    #[error("input of {len} bytes exceeds the decode limit of {DECODE_BYTES_MAX} bytes")]
    TooLarge { len: usize },
    #[error("cannot encode: {0}")]
    Encode(#[from] bincode::error::EncodeError),
    #[error("cannot decode: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    #[error("{trailing} trailing bytes after the encoded value")]
    Trailing { trailing: usize },
}

impl CodecError {
    /// This error, naming the stored value it is about (`what`: "snapshot",
    /// "raft vote", ...).
    pub fn named(self, what: impl Into<String>) -> NamedCodecError {
        NamedCodecError {
            what: what.into(),
            source: self,
        }
    }
}

/// A stored value that does not decode, named: `snapshot format version 7
/// is newer than this build reads (3): upgrade the binary`.
#[derive(Debug)]
pub struct NamedCodecError {
    pub what: String,
    pub source: CodecError,
}

impl std::fmt::Display for NamedCodecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.source {
            CodecError::Version { .. } => write!(f, "{} {}", self.what, self.source),
            other => write!(f, "{} does not decode: {other}", self.what),
        }
    }
}

impl std::error::Error for NamedCodecError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Decodes a stored value, naming it (`what`) in the error.
pub fn decode_named<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, NamedCodecError> {
    decode(bytes).map_err(|e| e.named(what))
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_BYTES_MAX>()
}

pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::with_capacity(64);
    out.push(FORMAT_VERSION);
    bincode::serde::encode_into_std_write(value, &mut out, config())?;
    Ok(out)
}

/// The length `encode` would return, without building the bytes.
pub fn encoded_len<T: Serialize>(value: &T) -> Result<usize, CodecError> {
    Ok(1 + bincode::serde::encode_into_std_write(value, &mut std::io::sink(), config())?)
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    let (&version, body) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::Version { found: version });
    }
    if body.len() > DECODE_BYTES_MAX {
        return Err(CodecError::TooLarge { len: body.len() });
    }
    let (value, used) = bincode::serde::decode_from_slice(body, config())?;
    if used != body.len() {
        return Err(CodecError::Trailing {
            trailing: body.len() - used,
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_version_checks() {
        let v = (7u64, "x".to_string(), vec![1u8, 2, 3]);
        let bytes = encode(&v).unwrap();
        assert_eq!(bytes[0], FORMAT_VERSION);
        let back: (u64, String, Vec<u8>) = decode(&bytes).unwrap();
        assert_eq!(back, v);

        let mut wrong = bytes.clone();
        wrong[0] = FORMAT_VERSION + 1;
        assert!(matches!(
            decode::<(u64, String, Vec<u8>)>(&wrong),
            Err(CodecError::Version { .. })
        ));
        assert!(matches!(decode::<u64>(&[]), Err(CodecError::Empty)));
        let mut trailing = bytes;
        trailing.push(0);
        assert!(matches!(
            decode::<(u64, String, Vec<u8>)>(&trailing),
            Err(CodecError::Trailing { .. })
        ));
    }

    /// Decoding dispatches on the version byte: this build's decodes; a
    /// newer one and a pre-release one are refused, named, with the version
    /// found and the one this build reads.
    #[test]
    fn other_format_versions_are_refused_naming_what_and_both_versions() {
        let bytes = encode(&(7u64, "x".to_string())).unwrap();
        assert_eq!(
            decode_named::<(u64, String)>("snapshot", &bytes).unwrap(),
            (7, "x".to_string())
        );
        let mut newer = bytes.clone();
        newer[0] = FORMAT_VERSION + 4;
        let err = decode_named::<(u64, String)>("snapshot", &newer).unwrap_err();
        assert!(matches!(err.source, CodecError::Version { found } if found == FORMAT_VERSION + 4));
        assert_eq!(
            err.to_string(),
            format!(
                "snapshot format version {} is newer than this build reads ({FORMAT_VERSION}): upgrade the binary",
                FORMAT_VERSION + 4
            )
        );
        let mut older = bytes.clone();
        older[0] = FORMAT_VERSION - 1;
        let err = decode_named::<(u64, String)>("raft vote", &older).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "raft vote format version {} is a pre-release layout, which this build does not read (it reads {FORMAT_VERSION})",
                FORMAT_VERSION - 1
            )
        );
        let err = decode_named::<(u64, String)>("snapshot", &bytes[..2]).unwrap_err();
        assert!(err.to_string().starts_with("snapshot does not decode: "), "{err}");
    }

    #[test]
    fn encoded_len_is_the_length_of_the_encoding() {
        for v in [
            (0u64, String::new(), vec![]),
            (7, "x".to_string(), vec![1u8, 2, 3]),
            (u64::MAX, "y".repeat(300), vec![9u8; 70_000]),
        ] {
            assert_eq!(encoded_len(&v).unwrap(), encode(&v).unwrap().len());
        }
    }

    #[test]
    fn hostile_length_prefix_is_refused_not_allocated() {
        // A Vec<u8> claiming u64::MAX elements: bincode varint 0xFF + 8 bytes.
        let mut bytes = vec![FORMAT_VERSION, 0xFF];
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<Vec<u8>>(&bytes).is_err());
    }
}
