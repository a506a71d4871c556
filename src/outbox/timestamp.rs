//! Reading `created_at` as PostgreSQL prints it, writing it as RFC 3339.
//!
//! `created_at` arrives as the text of PostgreSQL's output function: the replication
//! session and the poller's connections run with `DateStyle=ISO` and `TimeZone=UTC`,
//! so a `timestamptz` reads `2026-11-30 14:29:33.123456+00` and a `timestamp` the
//! same without offset, which is taken as UTC
//! (<https://www.postgresql.org/docs/current/datatype-datetime.html#DATATYPE-DATETIME-OUTPUT>).
//! Any offset is accepted, to the second (historical zones print `+00:03:58`), so
//! text rendered in another time zone reads the same instant.
//! The parser accepts exactly that shape and refuses everything else with a typed
//! [`TimestampProblem`]: `infinity`, BC dates and years past 9999 are valid
//! PostgreSQL values that no RFC 3339 header (nor Kafka CreateTime) can express,
//! so such rows become unmappable instead of being silently clamped.
//!
//! Parsing by hand rather than with `chrono` keeps the hot path allocation-free and
//! the accepted grammar explicit; the property tests check both directions against
//! `chrono`. Dates use H. Hinnant's proleptic Gregorian day-count algorithms
//! (<https://howardhinnant.github.io/date_algorithms.html>).

use bytes::BufMut;

/// Length of `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub(super) const RFC3339_LEN: usize = 27;
/// 0001-01-01T00:00:00Z in Unix microseconds.
pub(super) const MIN_MICROS: i64 = -62_135_596_800_000_000;
/// 9999-12-31T23:59:59.999999Z in Unix microseconds.
pub(super) const MAX_MICROS: i64 = 253_402_300_799_999_999;
const MICROS_PER_SECOND: i64 = 1_000_000;
const SECONDS_PER_DAY: i64 = 86_400;

/// Why a `created_at` text is not a usable timestamp.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "timestamp {input:?} {problem} (expected PostgreSQL ISO output like 2026-11-30 14:29:33.123456+00, years 1-9999)"
)]
pub(super) struct TimestampError {
    /// The text (its first 64 bytes, lossy UTF-8).
    input: String,
    /// What is wrong with it.
    pub(super) problem: TimestampProblem,
}

/// What is wrong with a timestamp text; the text is a phrase following the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum TimestampProblem {
    /// `infinity` or `-infinity`.
    #[error("is infinite")]
    Infinite,
    /// A BC date (RFC 3339 has no years before 1).
    #[error("is a BC date")]
    BeforeChrist,
    /// More than four year digits.
    #[error("has a year past 9999")]
    YearPast9999,
    /// The text does not start with a 4-digit year.
    #[error("has no 4-digit year")]
    NoYear,
    /// No `-` after the year.
    #[error("is malformed after the year")]
    MalformedAfterYear,
    /// No 2-digit month.
    #[error("has no 2-digit month")]
    NoMonth,
    /// No `-` after the month.
    #[error("is malformed after the month")]
    MalformedAfterMonth,
    /// No 2-digit day.
    #[error("has no 2-digit day")]
    NoDay,
    /// Year 0 does not exist.
    #[error("has year 0")]
    YearZero,
    /// Month or day out of range for the calendar.
    #[error("has no such date")]
    NoSuchDate,
    /// No ` ` or `T` and a time after the date.
    #[error("has no time after the date")]
    NoTime,
    /// No 2-digit hour.
    #[error("has no 2-digit hour")]
    NoHour,
    /// No `:` after the hour.
    #[error("is malformed after the hour")]
    MalformedAfterHour,
    /// No 2-digit minute.
    #[error("has no 2-digit minute")]
    NoMinute,
    /// No `:` after the minute.
    #[error("is malformed after the minute")]
    MalformedAfterMinute,
    /// No 2-digit second.
    #[error("has no 2-digit second")]
    NoSecond,
    /// Hour, minute or second out of range.
    #[error("has no such time of day")]
    NoSuchTime,
    /// A fraction of no or more than six digits.
    #[error("has a fraction of other than 1 to 6 digits")]
    FractionDigits,
    /// A fraction that is not digits.
    #[error("has a bad fraction")]
    BadFraction,
    /// A UTC offset that is not `±HH[:MM[:SS]]`.
    #[error("has a malformed UTC offset")]
    MalformedOffset,
    /// A UTC offset beyond ±15:59:59.
    #[error("has a UTC offset out of range")]
    OffsetOutOfRange,
    /// Something other than an offset after the time.
    #[error("has unexpected characters after the time")]
    UnexpectedAfterTime,
    /// Characters after the offset.
    #[error("has trailing characters")]
    TrailingCharacters,
    /// Outside years 1–9999 once converted to UTC.
    #[error("is outside years 1-9999 in UTC")]
    OutsideRange,
}

/// Parses PostgreSQL's ISO text output of `timestamptz` (`DateStyle=ISO`) or
/// `timestamp` into Unix microseconds: `YYYY-MM-DD HH:MM:SS[.f{1,6}][±HH[:MM[:SS]]]`.
/// Without an offset (`timestamp without time zone`) the value is taken as UTC;
/// `T` is accepted for the space and `Z` for `+00`.
///
/// # Errors
///
/// Anything else, including `infinity`, `-infinity`, BC dates and years past 9999
/// (which RFC 3339 cannot express), and values that fall outside years 1–9999
/// once converted to UTC.
pub(super) fn parse_pg_timestamp(text: &[u8]) -> Result<i64, TimestampError> {
    let err = |problem: TimestampProblem| TimestampError {
        input: String::from_utf8_lossy(&text[..text.len().min(64)]).into_owned(),
        problem,
    };
    match text {
        b"infinity" | b"-infinity" => return Err(err(TimestampProblem::Infinite)),
        _ if text.ends_with(b" BC") => return Err(err(TimestampProblem::BeforeChrist)),
        _ => {}
    }
    let mut c = Cursor { b: text, i: 0 };
    let year_digits = c.b.iter().take_while(|b| b.is_ascii_digit()).count();
    if year_digits > 4 {
        return Err(err(TimestampProblem::YearPast9999));
    }
    let year = c.digits(4).ok_or_else(|| err(TimestampProblem::NoYear))?;
    c.expect(b'-')
        .ok_or_else(|| err(TimestampProblem::MalformedAfterYear))?;
    let month = c.digits(2).ok_or_else(|| err(TimestampProblem::NoMonth))?;
    c.expect(b'-')
        .ok_or_else(|| err(TimestampProblem::MalformedAfterMonth))?;
    let day = c.digits(2).ok_or_else(|| err(TimestampProblem::NoDay))?;
    if year == 0 {
        return Err(err(TimestampProblem::YearZero));
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return Err(err(TimestampProblem::NoSuchDate));
    }
    match c.bump() {
        Some(b' ' | b'T') => {}
        _ => return Err(err(TimestampProblem::NoTime)),
    }
    let hour = c.digits(2).ok_or_else(|| err(TimestampProblem::NoHour))?;
    c.expect(b':')
        .ok_or_else(|| err(TimestampProblem::MalformedAfterHour))?;
    let minute = c.digits(2).ok_or_else(|| err(TimestampProblem::NoMinute))?;
    c.expect(b':')
        .ok_or_else(|| err(TimestampProblem::MalformedAfterMinute))?;
    let second = c.digits(2).ok_or_else(|| err(TimestampProblem::NoSecond))?;
    if hour > 23 || minute > 59 || second > 59 {
        return Err(err(TimestampProblem::NoSuchTime));
    }
    let mut micros = 0;
    if c.peek() == Some(b'.') {
        c.i += 1;
        let n = c.b[c.i..].iter().take_while(|b| b.is_ascii_digit()).count();
        if n == 0 || n > 6 {
            return Err(err(TimestampProblem::FractionDigits));
        }
        micros = c
            .digits(n)
            .ok_or_else(|| err(TimestampProblem::BadFraction))?;
        for _ in n..6 {
            micros *= 10;
        }
    }
    let offset_seconds = match c.bump() {
        None => 0,
        Some(b'Z') => 0,
        Some(sign @ (b'+' | b'-')) => {
            let h = c
                .digits(2)
                .ok_or_else(|| err(TimestampProblem::MalformedOffset))?;
            let mut m = 0;
            let mut s = 0;
            if c.peek() == Some(b':') {
                c.i += 1;
                m = c
                    .digits(2)
                    .ok_or_else(|| err(TimestampProblem::MalformedOffset))?;
                if c.peek() == Some(b':') {
                    c.i += 1;
                    s = c
                        .digits(2)
                        .ok_or_else(|| err(TimestampProblem::MalformedOffset))?;
                }
            }
            if h > 15 || m > 59 || s > 59 {
                return Err(err(TimestampProblem::OffsetOutOfRange));
            }
            let total = h * 3600 + m * 60 + s;
            if sign == b'-' { -total } else { total }
        }
        Some(_) => return Err(err(TimestampProblem::UnexpectedAfterTime)),
    };
    if c.peek().is_some() {
        return Err(err(TimestampProblem::TrailingCharacters));
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * SECONDS_PER_DAY + hour * 3600 + minute * 60 + second - offset_seconds;
    let unix_micros = seconds * MICROS_PER_SECOND + micros;
    if !(MIN_MICROS..=MAX_MICROS).contains(&unix_micros) {
        return Err(err(TimestampProblem::OutsideRange));
    }
    Ok(unix_micros)
}

/// Formats Unix microseconds as RFC 3339 in UTC with microseconds,
/// `2026-11-30T14:29:33.123456Z`; `None` outside years 1–9999.
#[must_use]
pub(super) fn format_rfc3339(unix_micros: i64) -> Option<String> {
    if !(MIN_MICROS..=MAX_MICROS).contains(&unix_micros) {
        return None;
    }
    let mut buf = Vec::with_capacity(RFC3339_LEN);
    put_rfc3339(&mut buf, unix_micros);
    String::from_utf8(buf).ok()
}

/// Writes RFC 3339 for `unix_micros`, which the caller has range-checked.
pub(super) fn put_rfc3339<B: BufMut>(out: &mut B, unix_micros: i64) {
    let seconds = unix_micros.div_euclid(MICROS_PER_SECOND);
    let days = seconds.div_euclid(SECONDS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    // All in range for u32 after the caller's check (years 1..=9999).
    let [year, month, day] = [year, month, day].map(|v| u32::try_from(v).unwrap_or(0));
    let micros = u32::try_from(unix_micros.rem_euclid(MICROS_PER_SECOND)).unwrap_or(0);
    let secs_of_day = u32::try_from(seconds.rem_euclid(SECONDS_PER_DAY)).unwrap_or(0);
    let mut buf = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |end: usize, width: usize, mut v: u32| {
        for slot in buf[end - width..end].iter_mut().rev() {
            *slot = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(4, 4, year);
    put(7, 2, month);
    put(10, 2, day);
    put(13, 2, secs_of_day / 3600);
    put(16, 2, secs_of_day / 60 % 60);
    put(19, 2, secs_of_day % 60);
    put(26, 6, micros);
    out.put_slice(&buf);
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn expect(&mut self, want: u8) -> Option<()> {
        (self.bump()? == want).then_some(())
    }

    /// Exactly `n` ASCII digits as a number.
    fn digits(&mut self, n: usize) -> Option<i64> {
        let s = self.b.get(self.i..self.i + n)?;
        let mut v = 0i64;
        for &d in s {
            if !d.is_ascii_digit() {
                return None;
            }
            v = v * 10 + i64::from(d - b'0');
        }
        self.i += n;
        Some(v)
    }
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01 (inverse of [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn timestamp_parsing() {
        let p = |s: &str| parse_pg_timestamp(s.as_bytes());
        let f = |s: &str| {
            p(s).ok()
                .and_then(format_rfc3339)
                .unwrap_or_else(|| panic!("{s}"))
        };
        assert_eq!(
            f("2026-11-30 14:29:33.123456+00"),
            "2026-11-30T14:29:33.123456Z"
        );
        assert_eq!(f("2026-11-30 14:29:33+00"), "2026-11-30T14:29:33.000000Z");
        assert_eq!(f("2026-11-30 14:29:33.1+00"), "2026-11-30T14:29:33.100000Z");
        assert_eq!(
            f("2026-11-30 14:29:33.12+00:00"),
            "2026-11-30T14:29:33.120000Z"
        );
        assert_eq!(
            f("2026-11-30 14:29:33+05:30"),
            "2026-11-30T08:59:33.000000Z"
        );
        assert_eq!(f("2026-11-30 23:29:33-03"), "2026-12-01T02:29:33.000000Z");
        assert_eq!(
            f("1883-11-18 12:03:58+00:03:58"),
            "1883-11-18T12:00:00.000000Z"
        );
        assert_eq!(f("2026-11-30 14:29:33"), "2026-11-30T14:29:33.000000Z");
        assert_eq!(f("2026-11-30T14:29:33Z"), "2026-11-30T14:29:33.000000Z");
        assert_eq!(f("2024-02-29 00:00:00+00"), "2024-02-29T00:00:00.000000Z");
        assert_eq!(f("2000-02-29 00:00:00+00"), "2000-02-29T00:00:00.000000Z");
        assert_eq!(f("0001-01-01 00:00:00+00"), "0001-01-01T00:00:00.000000Z");
        assert_eq!(
            f("9999-12-31 23:59:59.999999+00"),
            "9999-12-31T23:59:59.999999Z"
        );
        assert_eq!(p("1970-01-01 00:00:00+00"), Ok(0));
        assert_eq!(p("1969-12-31 23:59:59.999999+00"), Ok(-1));

        use TimestampProblem::*;
        for (bad, problem) in [
            ("infinity", Infinite),
            ("-infinity", Infinite),
            ("0044-03-15 12:00:00+00 BC", BeforeChrist),
            ("10000-01-01 00:00:00+00", YearPast9999),
            ("275760-09-13 00:00:00+00", YearPast9999),
            ("0000-01-01 00:00:00+00", YearZero),
            ("0001-01-01 00:00:00+01", OutsideRange),
            ("9999-12-31 23:59:59-01", OutsideRange),
            ("2026-02-29 00:00:00+00", NoSuchDate),
            ("1900-02-29 00:00:00+00", NoSuchDate),
            ("2026-13-01 00:00:00+00", NoSuchDate),
            ("2026-04-31 00:00:00+00", NoSuchDate),
            ("2026-01-00 00:00:00+00", NoSuchDate),
            ("2026-01-01 24:00:00+00", NoSuchTime),
            ("2026-01-01 23:60:00+00", NoSuchTime),
            ("2026-01-01 23:59:60+00", NoSuchTime),
            ("2026-01-01 00:00:00.1234567+00", FractionDigits),
            ("2026-01-01 00:00:00.+00", FractionDigits),
            ("2026-01-01 00:00:00+16", OffsetOutOfRange),
            ("2026-01-01 00:00:00+5", MalformedOffset),
            ("2026-01-01 00:00:00+05:3", MalformedOffset),
            ("2026-01-01 00:00:00+00 ", TrailingCharacters),
            ("2026-01-01 00:00:00 UTC", UnexpectedAfterTime),
            ("2026-01-01", NoTime),
            ("26-01-01 00:00:00+00", NoYear),
            ("2026/01/01 00:00:00+00", MalformedAfterYear),
            ("2026-1-01 00:00:00+00", NoMonth),
            ("", NoYear),
            ("２０２６-01-01 00:00:00+00", NoYear),
        ] {
            let err = p(bad).unwrap_err();
            assert_eq!(err.problem, problem, "{bad:?}: {err}");
            assert!(
                err.to_string()
                    .contains(&format!("{problem} (expected PostgreSQL ISO output")),
                "{err}"
            );
        }
        assert_eq!(
            p("infinity").unwrap_err().to_string(),
            "timestamp \"infinity\" is infinite (expected PostgreSQL ISO output like 2026-11-30 14:29:33.123456+00, years 1-9999)"
        );
        assert_eq!(format_rfc3339(MAX_MICROS + 1), None);
        assert_eq!(format_rfc3339(MIN_MICROS - 1), None);
        assert_eq!(
            format_rfc3339(-1).as_deref(),
            Some("1969-12-31T23:59:59.999999Z")
        );
    }

    proptest! {
        #[test]
        fn rfc3339_matches_chrono(micros in MIN_MICROS..=MAX_MICROS) {
            let ours = format_rfc3339(micros).unwrap();
            let theirs = chrono::DateTime::from_timestamp_micros(micros)
                .unwrap()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            prop_assert_eq!(&ours, &theirs);
        }

        #[test]
        fn postgres_text_round_trips(
            micros in MIN_MICROS + 86_400_000_000..=MAX_MICROS - 86_400_000_000,
            offset_minutes in -15 * 60i32..=15 * 60,
            trim_fraction in any::<bool>(),
        ) {
            // Render like PostgreSQL would in a session with that UTC offset.
            let micros = if trim_fraction { micros - micros.rem_euclid(1_000_000) } else { micros };
            let offset = chrono::FixedOffset::east_opt(offset_minutes * 60).unwrap();
            let local = chrono::DateTime::from_timestamp_micros(micros).unwrap().with_timezone(&offset);
            let mut text = local.format("%Y-%m-%d %H:%M:%S").to_string();
            let frac = micros.rem_euclid(1_000_000);
            if frac != 0 {
                let digits = format!("{frac:06}");
                text.push('.');
                text.push_str(digits.trim_end_matches('0'));
            }
            let (sign, abs) = if offset_minutes < 0 { ('-', -offset_minutes) } else { ('+', offset_minutes) };
            text.push_str(&format!("{sign}{:02}", abs / 60));
            if abs % 60 != 0 {
                text.push_str(&format!(":{:02}", abs % 60));
            }
            prop_assert_eq!(parse_pg_timestamp(text.as_bytes()), Ok(micros), "{}", text);
        }

        #[test]
        fn timestamp_parser_never_panics(s in "[0-9 :+.TZ-]{0,34}", b in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = parse_pg_timestamp(s.as_bytes());
            let _ = parse_pg_timestamp(&b);
        }
    }
}
