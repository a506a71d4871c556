//! Best-effort redaction of PostgreSQL passwords in text that was not (or could not
//! be) parsed.
//!
//! A URL that parses is never printed at all: what the relay shows of a connection is
//! built from the parsed value (`ConnInfo`'s `Display` and `Debug`), which leaves the
//! password out. This module covers the rest: the configured URL in the config's
//! `Debug` and serialized forms, a URL that failed to parse, a `--set` argument, and
//! TOML errors that quote a line of the file.
//!
//! Such text has no reliable structure. A password with an unencoded `/` or `?`
//! (`postgresql://relay:pa/ss@db/app`) ends the authority early, and its halves then
//! look like a host and a port, a path or a query: a redaction that first parses the
//! URL's authority misses it (that was a real leak). So the rules here are greedy and
//! hide more than the password rather than risk printing part of it:
//!
//! - after `://`, everything from the first `:` up to the **last** `@` of the line
//!   becomes `***`; the user name before the `:` stays visible, but a host, path or
//!   query before that `@` is hidden too;
//! - the value of every `password=` (so also `sslpassword=`) becomes `***`, up to the
//!   next `&` or white space that starts another libpq keyword (`&sslmode=`,
//!   ` user=`), else to the end of the line; an unencoded `&` inside a password thus
//!   does not end it.
//!
//! Both apply line by line, so a multi-line error message is covered as well.

/// Whether a librdkafka setting holds a secret whose value must never be shown:
/// passwords (`sasl.password`, `ssl.key.password`, `ssl.keystore.password`),
/// secrets and passphrases (`sasl.oauthbearer.client.secret`, …) and inline private
/// keys (`ssl.key.pem`, `sasl.oauthbearer.assertion.private.key.pem`). Names are
/// compared without regard to case.
#[must_use]
pub fn is_secret_setting(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "secret", "passphrase", "key.pem"]
        .iter()
        .any(|part| key.contains(part))
}

/// What stands in for a hidden password.
const MASK: &str = "***";

/// libpq's connection keywords: only one of these after `&` or white space ends a
/// `password=` value (<https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-PARAMKEYWORDS>).
const KEYWORDS: &[&str] = &[
    "application_name",
    "channel_binding",
    "client_encoding",
    "connect_timeout",
    "dbname",
    "fallback_application_name",
    "gssdelegation",
    "gssencmode",
    "gsslib",
    "host",
    "hostaddr",
    "keepalives",
    "keepalives_count",
    "keepalives_idle",
    "keepalives_interval",
    "krbsrvname",
    "load_balance_hosts",
    "options",
    "passfile",
    "password",
    "port",
    "replication",
    "require_auth",
    "requirepeer",
    "service",
    "ssl_max_protocol_version",
    "ssl_min_protocol_version",
    "sslcert",
    "sslcertmode",
    "sslcompression",
    "sslcrl",
    "sslcrldir",
    "sslkey",
    "sslmode",
    "sslnegotiation",
    "sslpassword",
    "sslrootcert",
    "sslsni",
    "target_session_attrs",
    "tcp_user_timeout",
    "user",
];

/// Hides the password of a `postgresql://user:password@host/db` URL, of a
/// `password=` parameter (URL query or `key=value` form), or of any such URL inside
/// free text, by the greedy rules of this module. For logs, `Debug` and error
/// messages; it never fails and never shows what it cannot place.
#[must_use]
pub fn redact_url(text: &str) -> String {
    let lines: Vec<String> = text.split('\n').map(redact_line).collect();
    lines.join("\n")
}

fn redact_line(line: &str) -> String {
    mask_password_values(&mask_userinfo(line))
}

/// `scheme://user:…@rest` → `scheme://user:***@rest`, taking the last `@` of the line.
fn mask_userinfo(line: &str) -> String {
    let Some(scheme_end) = line.find("://") else {
        return line.to_owned();
    };
    let start = scheme_end + "://".len();
    let rest = &line[start..];
    let Some(at) = rest.rfind('@') else {
        return line.to_owned();
    };
    let Some(colon) = rest[..at].find(':') else {
        return line.to_owned();
    };
    format!("{}:{MASK}{}", &line[..start + colon], &rest[at..])
}

/// Every `password=value` (ASCII case ignored) → `password=***`.
fn mask_password_values(line: &str) -> String {
    const KEY: &str = "password=";
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    // ASCII lowercasing keeps every byte offset, so positions found in the
    // lowercase copy are valid in the original.
    while let Some(found) = rest.to_ascii_lowercase().find(KEY) {
        let value_start = found + KEY.len();
        out.push_str(&rest[..value_start]);
        out.push_str(MASK);
        let value = &rest[value_start..];
        rest = &value[value_len(value)..];
    }
    out.push_str(rest);
    out
}

/// Bytes of a `password=` value: up to the `&` or white space that starts another
/// keyword, else all of `s`.
fn value_len(s: &str) -> usize {
    s.char_indices()
        .filter(|&(_, c)| c == '&' || c.is_whitespace())
        .find(|&(i, c)| starts_with_keyword(&s[i + c.len_utf8()..]))
        .map_or(s.len(), |(i, _)| i)
}

/// `s` begins with `keyword=` for one of libpq's keywords.
fn starts_with_keyword(s: &str) -> bool {
    let name_len = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    s[name_len..].starts_with('=') && KEYWORDS.contains(&&s[..name_len])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Passwords with every character that breaks a URL's structure, raw and
    /// percent-encoded. Their letters occur nowhere else in the test URLs.
    const SECRETS: &[&str] = &[
        "Kx7/Qz9",
        "Kx7?Qz9",
        "Kx7@Qz9",
        "Kx7:Qz9",
        "Kx7#Qz9",
        "Kx7&Qz9",
        "Kx7 Qz9",
        "Kx7/?@:#& Qz9",
        "Kx7%2FQz9",
        "Kx7%3FQz9%40Wv%3A%23",
        "Kx7%zzQz9",
    ];

    /// Neither the secret nor any run of three or more of its letters and digits
    /// (the halves a `/` or `?` splits it into) is shown.
    fn assert_hidden(text: &str, secret: &str) {
        let shown = redact_url(text);
        assert!(!shown.contains(secret), "{secret:?} shown in {shown:?}");
        for run in secret
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|r| r.len() >= 3)
        {
            assert!(
                !shown.contains(run),
                "{run:?} of {secret:?} shown in {shown:?} (from {text:?})"
            );
        }
    }

    #[test]
    fn userinfo_passwords_are_hidden_whatever_they_contain() {
        for secret in SECRETS {
            for url in [
                format!("postgresql://relay:{secret}@127.0.0.1:1/app"),
                format!("postgres://relay:{secret}@db/app?sslmode=require"),
                format!("postgresql://:{secret}@db"),
            ] {
                assert_hidden(&url, secret);
            }
        }
    }

    #[test]
    fn password_parameters_are_hidden_whatever_they_contain() {
        for secret in SECRETS {
            for url in [
                format!("postgresql://relay@db/app?password={secret}"),
                format!("postgresql://relay@db/app?password={secret}&sslmode=require"),
                format!("postgresql://relay@db/app?sslpassword=x&password={secret}"),
                format!("host=db password={secret} user=relay"),
                format!("host=db PASSWORD={secret}"),
            ] {
                assert_hidden(&url, secret);
            }
        }
    }

    #[test]
    fn keeps_what_is_not_secret() {
        assert_eq!(
            redact_url("postgresql://u:p@h/db"),
            "postgresql://u:***@h/db"
        );
        assert_eq!(
            redact_url("postgresql://u@h:5432/db"),
            "postgresql://u@h:5432/db"
        );
        assert_eq!(
            redact_url("postgresql://relay:pa/ss@127.0.0.1:1/app"),
            "postgresql://relay:***@127.0.0.1:1/app"
        );
        assert_eq!(
            redact_url("host=h password=xyz user=u"),
            "host=h password=*** user=u"
        );
        assert_eq!(
            redact_url("postgresql://h/db?user=u&password=pw&sslmode=require"),
            "postgresql://h/db?user=u&password=***&sslmode=require"
        );
        // Not a keyword: the `&` is taken to be part of the password.
        assert_eq!(
            redact_url("postgresql://h/db?password=a&b=c"),
            "postgresql://h/db?password=***"
        );
        assert_eq!(
            redact_url("postgresql://h/db?password=a&password=b"),
            "postgresql://h/db?password=***&password=***"
        );
    }

    #[test]
    fn works_line_by_line_in_free_text() {
        let text = "TOML parse error at line 2, column 24\n  |\n2 | url = \"postgresql://relay:pa\\ss@db/app\"\n  |                        ^\ninvalid escape";
        let shown = redact_url(text);
        assert!(!shown.contains("pa\\ss"), "{shown}");
        assert!(shown.contains("relay:***@db/app"), "{shown}");
        assert!(shown.ends_with("invalid escape"), "{shown}");
    }

    #[test]
    fn never_panics_on_odd_text() {
        for text in [
            "",
            "://",
            "://@",
            ":@",
            "password=",
            "a://b:c",
            "é://ü:ö@ä password=é&é",
        ] {
            let _ = redact_url(text);
        }
    }
}
