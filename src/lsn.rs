//! PostgreSQL write-ahead-log positions.
//!
//! An LSN is a 64-bit byte position in the WAL. PostgreSQL prints it as two
//! hexadecimal halves, `X/Y` (high 32 bits / low 32 bits, no zero padding), e.g.
//! `16/B374D848`; `pg_lsn` columns, `IDENTIFY_SYSTEM`, `START_REPLICATION` and the
//! `pg_replication_slots` view all use that text form, while the streaming protocol
//! (XLogData, keepalive, standby status update) carries the raw `u64` big-endian.
//! See <https://www.postgresql.org/docs/current/datatype-pg-lsn.html>.

use std::fmt;
use std::str::FromStr;

/// A WAL position. `Lsn(0)` is PostgreSQL's `InvalidXLogRecPtr` (`0/0`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `0/0`, "no position".
    pub const ZERO: Lsn = Lsn(0);

    /// The raw 64-bit value as carried on the wire.
    #[must_use]
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// True for `0/0`.
    #[must_use]
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// Bytes from `earlier` to `self`, zero when `earlier` is ahead.
    #[must_use]
    pub const fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

impl From<Lsn> for u64 {
    fn from(l: Lsn) -> Self {
        l.0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// Why a string is not an LSN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {input:?}: expected two hexadecimal halves like 16/B374D848")]
pub struct ParseLsnError {
    input: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            input: s.to_owned(),
        };
        let (hi, lo) = s.trim().split_once('/').ok_or_else(err)?;
        let half = |h: &str| {
            if h.is_empty() || h.len() > 8 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            u32::from_str_radix(h, 16).map_err(|_| err())
        };
        Ok(Lsn((u64::from(half(hi)?) << 32) | u64::from(half(lo)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_like_postgres() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn parses_postgres_text() {
        assert_eq!("16/B374D848".parse::<Lsn>(), Ok(Lsn(0x16_B374_D848)));
        assert_eq!("0/1".parse::<Lsn>(), Ok(Lsn(1)));
        assert_eq!("a/b".parse::<Lsn>(), Ok(Lsn((0xa << 32) | 0xb)));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "/",
            "1/",
            "/1",
            "1",
            "g/1",
            "1/1/1",
            "123456789/0",
            "-1/0",
            "+1/0",
        ] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} must not parse");
        }
    }

    #[test]
    fn bytes_since_saturates() {
        assert_eq!(Lsn(10).bytes_since(Lsn(4)), 6);
        assert_eq!(Lsn(4).bytes_since(Lsn(10)), 0);
    }

    proptest! {
        #[test]
        fn display_then_parse_round_trips(v in any::<u64>()) {
            prop_assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }

        #[test]
        fn parse_never_panics(s in ".{0,24}") {
            let _ = s.parse::<Lsn>();
        }
    }
}
