//! The one rule for reading a stored format
//! (docs/adr/0042-storage-engines.md): every stored format carries a format
//! version, and reading dispatches on it. The version this build writes
//! decodes; a higher one is refused (written by a newer build: upgrade the
//! binary); a lower one, or none at all, is a pre-release layout, which no
//! build reads. Nothing is converted in place and nothing is decoded by
//! trying one layout after another.
//!
//! Each store keeps its own version number and says what it reads
//! (`codec::FORMAT_VERSION` for the coordinator's encoded values,
//! [`crate::wal::WAL_FORMAT_VERSION`] for the log files, the participant
//! store's for its checkpoint, batches and records); this module gives
//! them one check and one wording, and the files of this crate's users
//! that are not `codec` values (the log files, the participant store's
//! checkpoint) one header: [`FILE_HEADER_BYTES`] bytes, an 8-byte magic
//! naming the kind of file, the format version (u32 LE), and a crc32 of
//! the twelve bytes before it. Every later version keeps those 16 bytes,
//! so any build can say which version a file is.

/// A stored format this build does not read, named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// Written by a newer build.
    #[error("{what} {}", describe(*found, *reads))]
    Newer { what: String, found: u64, reads: u64 },
    /// A pre-release layout with a version number below this build's.
    #[error("{what} {}", describe(*found, *reads))]
    Older { what: String, found: u64, reads: u64 },
    /// A pre-release layout from before the format carried a version.
    #[error("{what} carries no format version: a pre-release layout, which this build does not read (it reads format version {reads})")]
    Unversioned { what: String, reads: u64 },
}

impl VersionError {
    /// The version found (`None`: the layout carries none).
    pub fn found(&self) -> Option<u64> {
        match self {
            VersionError::Newer { found, .. } | VersionError::Older { found, .. } => Some(*found),
            VersionError::Unversioned { .. } => None,
        }
    }

    /// Written by a newer build (upgrading the binary reads it).
    pub fn is_newer(&self) -> bool {
        matches!(self, VersionError::Newer { .. })
    }
}

/// What is wrong with format version `found` for a build that reads
/// `reads`, without naming the thing: `format version 7 is newer than this
/// build reads (1): upgrade the binary`. Empty when they are the same.
pub fn describe(found: u64, reads: u64) -> String {
    if found > reads {
        format!("format version {found} is newer than this build reads ({reads}): upgrade the binary")
    } else if found < reads {
        format!("format version {found} is a pre-release layout, which this build does not read (it reads {reads})")
    } else {
        String::new()
    }
}

/// `Ok` when `found` is the version this build reads (`reads`); otherwise
/// the refusal, naming `what` (called only then).
pub fn check(what: impl FnOnce() -> String, found: u64, reads: u64) -> Result<(), VersionError> {
    if found == reads {
        Ok(())
    } else if found > reads {
        Err(VersionError::Newer {
            what: what(),
            found,
            reads,
        })
    } else {
        Err(VersionError::Older {
            what: what(),
            found,
            reads,
        })
    }
}

/// The size of a file header ([`file_header`]).
pub const FILE_HEADER_BYTES: usize = 16;

/// The header that starts a file of the kind `magic` names, in format
/// `version`.
pub fn file_header(magic: &[u8; 8], version: u32) -> [u8; FILE_HEADER_BYTES] {
    let mut h = [0u8; FILE_HEADER_BYTES];
    h[..8].copy_from_slice(magic);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    let crc = crc32fast::hash(&h[..12]);
    h[12..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The format version in the header at the start of `bytes`, if they start
/// with a whole header of the kind `magic` names whose checksum holds.
pub fn read_file_header(magic: &[u8; 8], bytes: &[u8]) -> Option<u32> {
    let h = bytes.get(..FILE_HEADER_BYTES)?;
    let crc = u32::from_le_bytes(h[12..].try_into().expect("4 bytes"));
    (&h[..8] == magic && crc32fast::hash(&h[..12]) == crc)
        .then(|| u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_header_reads_back_and_a_damaged_or_foreign_one_does_not() {
        const MAGIC: &[u8; 8] = b"DTX-TST\n";
        let h = file_header(MAGIC, 5);
        assert_eq!(read_file_header(MAGIC, &h), Some(5));
        let mut file = h.to_vec();
        file.extend_from_slice(b"the rest");
        assert_eq!(read_file_header(MAGIC, &file), Some(5));
        assert_eq!(read_file_header(b"DTX-OTH\n", &h), None, "another kind of file");
        assert_eq!(read_file_header(MAGIC, &h[..15]), None, "cut short");
        for i in 0..FILE_HEADER_BYTES {
            let mut bad = h;
            bad[i] ^= 0x10;
            assert_eq!(read_file_header(MAGIC, &bad), None, "byte {i} flipped");
        }
    }

    #[test]
    fn the_version_this_build_reads_passes_and_others_are_refused_by_name() {
        assert_eq!(check(|| unreachable!("named only when refused"), 3, 3), Ok(()));
        let newer = check(|| "snapshot".into(), 7, 1).unwrap_err();
        assert!(newer.is_newer());
        assert_eq!(newer.found(), Some(7));
        assert_eq!(
            newer.to_string(),
            "snapshot format version 7 is newer than this build reads (1): upgrade the binary"
        );
        let older = check(|| "snapshot".into(), 1, 3).unwrap_err();
        assert!(!older.is_newer());
        assert_eq!(
            older.to_string(),
            "snapshot format version 1 is a pre-release layout, which this build does not read (it reads 3)"
        );
        let none = VersionError::Unversioned {
            what: "log file x.wal".into(),
            reads: 1,
        };
        assert_eq!(none.found(), None);
        assert_eq!(
            none.to_string(),
            "log file x.wal carries no format version: a pre-release layout, which this build does not read (it reads format version 1)"
        );
    }
}
