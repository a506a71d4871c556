//! Human durations in the config and on the command line: `90s`, `15m`, `1h30m`,
//! `2d`, `1w`, `1500ms`.
//!
//! One or more `<number><unit>` parts, no spaces and no sign; the parts add up.
//! Written by hand rather than with a crate because the accepted grammar is part of
//! the CLI contract (`audit --since 2d`, `retention.period = "7d"`) and is this small.

use std::time::Duration;

/// Why a duration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DurationError {
    #[error("empty")]
    Empty,
    #[error("expected a number at {0:?}")]
    ExpectedNumber(String),
    #[error("number {0:?} too large")]
    NumberTooLarge(String),
    #[error("{0} has no unit (s, m, h, d, w)")]
    MissingUnit(u64),
    #[error("unknown unit {0:?} (s, m, h, d, w)")]
    UnknownUnit(String),
    #[error("{0} is too large")]
    TooLarge(String),
}

/// `90s`, `15m`, `1h30m`, `2d`, `1w` (also `ms`); at least one `<number><unit>`.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(DurationError::ExpectedNumber(rest.to_owned()));
        }
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| DurationError::NumberTooLarge(rest[..digits].to_owned()))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let secs: u64 = match unit {
            "ms" => {
                total = total.saturating_add(Duration::from_millis(n));
                continue;
            }
            "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86_400,
            "w" => 7 * 86_400,
            "" => return Err(DurationError::MissingUnit(n)),
            other => return Err(DurationError::UnknownUnit(other.to_owned())),
        };
        let part = n
            .checked_mul(secs)
            .ok_or_else(|| DurationError::TooLarge(format!("{n}{unit}")))?;
        total = total.saturating_add(Duration::from_secs(part));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        let d = |s: &str| parse_duration(s).map(|d| d.as_secs());
        assert_eq!(d("90s"), Ok(90));
        assert_eq!(d("15m"), Ok(900));
        assert_eq!(d("1h30m"), Ok(5400));
        assert_eq!(d("2d"), Ok(172_800));
        assert_eq!(d("1w"), Ok(604_800));
        assert_eq!(parse_duration("1500ms").map(|d| d.as_millis()), Ok(1500));
    }

    #[test]
    fn bad_durations_say_why() {
        use DurationError as E;
        let cases = [
            ("", E::Empty),
            ("h", E::ExpectedNumber("h".into())),
            ("10", E::MissingUnit(10)),
            ("1x", E::UnknownUnit("x".into())),
            ("1h 2m", E::ExpectedNumber(" 2m".into())),
            ("-1h", E::ExpectedNumber("-1h".into())),
            (
                "99999999999999999999s",
                E::NumberTooLarge("99999999999999999999".into()),
            ),
            (
                "99999999999999999w",
                E::TooLarge("99999999999999999w".into()),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(parse_duration(input), Err(want), "{input:?}");
        }
    }
}
