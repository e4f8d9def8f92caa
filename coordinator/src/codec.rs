//! All binary encoding lives here: one format version byte, then bincode 2
//! (serde, standard config). Decoding is bounded by `limits::DECODE_BYTES_MAX`
//! so a hostile or damaged input cannot make us allocate without limit.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::limits::DECODE_BYTES_MAX;

/// Bumped whenever an encoded type changes incompatibly. 2: one-phase
/// commit and BeginAndCommit (new command kinds, `one_phase` in every
/// transaction record).
pub const FORMAT_VERSION: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty input (no format version byte)")]
    Empty,
    #[error("format version {found} is not supported (this build reads version {FORMAT_VERSION})")]
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
