//! The configuration's documentation, checked against the parser.
//!
//! `config/relay.example.toml` is the reference a user copies and
//! `docs/configuration.md` the page that explains each key; both are prose no compiler
//! reads, so a key added, renamed or removed in the code leaves them behind silently.
//! These tests make that drift fail:
//!
//! * **The example loads with the real loader** ([`Config::from_sources`], which
//!   validates), as shipped and with each of its commented-out samples turned on
//!   (`# [kafka.envelope]`, `# progress_topic_replication_factor = 3`, …). The loader
//!   refuses unknown keys, so every key the example shows is one the parser reads.
//!   That refusal is checked too, section by section: a section that stopped denying
//!   unknown keys would make the first check prove nothing. The one free-form section,
//!   `[kafka.producer]` (librdkafka's own settings, passed through), is checked by
//!   librdkafka instead, in `kafka::config`'s tests.
//! * **Every key of the example is on the configuration page**: `section.key` has a
//!   row in the key table under a heading that names `[section]`; a `[kafka.producer]`
//!   setting, which has no row (its names are librdkafka's), appears in a TOML example
//!   of the `[kafka]` part.
//! * **Links between the documents lead somewhere**: every relative link of
//!   `README.md` and `docs/*.md` names a file that exists and, with `#anchor`, a
//!   heading of it.
//!
//! The other direction, that every key the parser has is in the example, is
//! `example_config_is_valid_and_complete` in the parent module; that every command is
//! in the commands tables, the tests of `crate::cli`.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::Config;

/// The example, as shipped.
const EXAMPLE: &str = include_str!("../../config/relay.example.toml");

/// The configuration page.
const CONFIGURATION_MD: &str = include_str!("../../docs/configuration.md");

/// The free-form section whose keys are librdkafka's.
const PASS_THROUGH: &str = "kafka.producer";

/// Whether `line` is a commented-out sample of the example: `# [section]` or
/// `# key = value` (`# "dotted.key" = value`), the `#` followed by one space and the
/// sample itself, as the example writes them, the sample a line of TOML. An indented
/// sample (`#   [[outbox]]`) is an illustration inside prose and stays off.
fn is_sample(line: &str) -> bool {
    let Some(rest) = line.strip_prefix("# ") else {
        return false;
    };
    if let Some(section) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        return !section.is_empty()
            && section
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'.');
    }
    let (key, after) = if let Some(quoted) = rest.strip_prefix('"') {
        match quoted.split_once('"') {
            Some((key, after)) => (key, after),
            None => return false,
        }
    } else {
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        rest.split_at(end)
    };
    // Prose can look like a sample (`publish = 'insert' only).`): a sample is TOML.
    !key.is_empty() && after.starts_with(" = ") && toml::from_str::<toml::Table>(rest).is_ok()
}

/// The runs of consecutive sample lines (line ranges) of `text`.
fn sample_runs(text: &str) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !is_sample(line) {
            continue;
        }
        match runs.last_mut() {
            Some(run) if run.end == i => run.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// `text` with the sample lines of `run` turned on.
fn with_run(text: &str, run: &Range<usize>) -> String {
    text.lines()
        .enumerate()
        .map(|(i, line)| match line.strip_prefix("# ") {
            Some(sample) if run.contains(&i) => sample,
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The example as shipped, then with each run of samples turned on (one at a time:
/// some exclude each other, such as `[kafka.envelope]` and `[kafka.cloudevents]`),
/// each with a label that names it.
pub(crate) fn example_variants() -> Vec<(String, String)> {
    let mut variants = vec![("the example as shipped".to_owned(), EXAMPLE.to_owned())];
    for run in sample_runs(EXAMPLE) {
        let label = format!(
            "the example with the samples of lines {}-{} on",
            run.start + 1,
            run.end
        );
        variants.push((label, with_run(EXAMPLE, &run)));
    }
    variants
}

fn load(label: &str, text: &str) -> Result<Config, super::ConfigError> {
    Config::from_sources(label, text, Vec::new())
}

/// Every `section.key` of a TOML document (nested sections joined with `.`), with the
/// section it is in.
fn keys(table: &toml::Table, section: &str, out: &mut BTreeSet<(String, String)>) {
    for (key, value) in table {
        match value {
            toml::Value::Table(inner) => {
                let path = if section.is_empty() {
                    key.clone()
                } else {
                    format!("{section}.{key}")
                };
                keys(inner, &path, out);
            }
            _ => {
                out.insert((section.to_owned(), key.clone()));
            }
        }
    }
}

/// The paths of every section of a TOML document (`""` for the top level).
fn sections(table: &toml::Table, path: &str, out: &mut Vec<String>) {
    out.push(path.to_owned());
    for (key, value) in table {
        if let toml::Value::Table(inner) = value {
            let inner_path = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            sections(inner, &inner_path, out);
        }
    }
}

fn section_mut<'a>(table: &'a mut toml::Table, path: &str) -> &'a mut toml::Table {
    if path.is_empty() {
        return table;
    }
    path.split('.').fold(table, |table, key| {
        table
            .get_mut(key)
            .and_then(toml::Value::as_table_mut)
            .unwrap_or_else(|| panic!("no section {path}"))
    })
}

/// A Markdown document's lines outside fenced code blocks, with their index; fence
/// lines themselves are left out.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i, line));
        }
    }
    out
}

/// A heading's level and text, for a line outside code blocks.
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.bytes().take_while(|&b| b == b'#').count();
    let text = line.get(level..)?.strip_prefix(' ')?;
    (1..=6).contains(&level).then_some((level, text.trim()))
}

/// The parts of `text` under each heading that names `` `[section]` ``: the heading's
/// line to the next heading of its level or above, code blocks included.
fn regions_of<'a>(text: &'a str, section: &str) -> Vec<Vec<&'a str>> {
    let lines: Vec<&str> = text.lines().collect();
    let headings: Vec<(usize, usize, &str)> = prose_lines(text)
        .into_iter()
        .filter_map(|(i, line)| heading(line).map(|(level, title)| (i, level, title)))
        .collect();
    let named = format!("`[{section}]`");
    headings
        .iter()
        .enumerate()
        .filter(|(_, (_, _, title))| title.contains(&named))
        .map(|(n, &(start, level, _))| {
            let end = headings[n + 1..]
                .iter()
                .find(|&&(_, other, _)| other <= level)
                .map_or(lines.len(), |&(i, _, _)| i);
            lines[start..end].to_vec()
        })
        .collect()
}

/// Whether the configuration page documents `section.key`.
fn documented(page: &str, section: &str, key: &str) -> bool {
    if section == PASS_THROUGH {
        // librdkafka's names have no rows: the `[kafka]` part shows them in TOML.
        let shown = format!("\"{key}\" = ");
        return regions_of(page, "kafka")
            .iter()
            .flatten()
            .any(|line| line.trim_start().starts_with(&shown));
    }
    let row = format!("| `{key}` |");
    regions_of(page, section)
        .iter()
        .flatten()
        .any(|line| line.starts_with(&row))
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as `-`.
fn slug(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown document's headings (a repeated one gets `-1`, `-2`, …).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let Some((_, title)) = heading(line) else {
            continue;
        };
        let base = slug(title);
        let count = seen.entry(base.clone()).or_insert(0);
        out.insert(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    out
}

/// The targets of the inline links (`[text](target)`) of a Markdown document,
/// outside code blocks, with their line number.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in prose_lines(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or_default();
            out.push((i + 1, target.to_owned()));
            rest = &rest[end..];
        }
    }
    out
}

/// The documents whose links are checked: `README.md` and `docs/*.md`.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.join("README.md")];
    let docs = std::fs::read_dir(root.join("docs")).expect("read docs/");
    let mut pages: Vec<PathBuf> = docs
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    out.extend(pages);
    out
}

#[test]
fn the_samples_are_found() {
    let runs = sample_runs(EXAMPLE);
    let lines: Vec<&str> = EXAMPLE.lines().collect();
    let first: Vec<&str> = runs.iter().map(|run| lines[run.start]).collect();
    // Each kind the example has: a section, a bare key, a quoted (dotted) key.
    for (kind, found) in [
        ("# [section]", first.iter().any(|l| l.starts_with("# ["))),
        (
            "# key = …",
            first.iter().any(|l| l.as_bytes()[2].is_ascii_lowercase()),
        ),
        (
            "# \"dotted.key\" = …",
            first.iter().any(|l| l.starts_with("# \"")),
        ),
    ] {
        assert!(found, "no sample {kind} found: {first:?}");
    }
    assert!(runs.len() >= 5, "{first:?}");
    // Prose is not a sample, nor an indented illustration.
    for prose in [
        "# bootstrap.servers",
        "# human or json",
        "#   [[outbox]]",
        "# OUTBOX_RELAY__KAFKA__PRODUCER__sasl.password=...",
        "# publish = 'insert' only).",
        "#",
    ] {
        assert!(!is_sample(prose), "{prose:?}");
    }
}

/// The example, and each of its samples turned on, loads with the real loader, and
/// each sample adds keys the loader then read.
#[test]
fn the_example_and_its_samples_load() {
    let variants = example_variants();
    let shipped: toml::Table = toml::from_str(EXAMPLE).expect("the example is TOML");
    let mut shipped_keys = BTreeSet::new();
    keys(&shipped, "", &mut shipped_keys);
    for (label, text) in &variants {
        load(label, text).unwrap_or_else(|e| panic!("{label} does not load: {e}"));
        let doc: toml::Table =
            toml::from_str(text).unwrap_or_else(|e| panic!("{label}: {}", e.message()));
        let mut found = BTreeSet::new();
        keys(&doc, "", &mut found);
        if label != "the example as shipped" {
            assert!(
                found.is_superset(&shipped_keys) && found.len() > shipped_keys.len(),
                "{label}: turning the samples on added no key"
            );
        }
    }
}

/// The loader refuses an unknown key in every section the example (with its
/// samples) has: so a key the example shows and the loader accepted is a key it
/// reads. `[kafka.producer]` is librdkafka's, checked by librdkafka.
#[test]
fn every_section_refuses_an_unknown_key() {
    let mut checked = BTreeSet::new();
    for (label, text) in example_variants() {
        let doc: toml::Table =
            toml::from_str(&text).unwrap_or_else(|e| panic!("{label}: {}", e.message()));
        let mut paths = Vec::new();
        sections(&doc, "", &mut paths);
        for path in paths {
            if path == PASS_THROUGH || !checked.insert(path.clone()) {
                continue;
            }
            let mut broken = doc.clone();
            section_mut(&mut broken, &path).insert("not_a_key".into(), toml::Value::Integer(1));
            let broken = toml::to_string(&broken).expect("serialize");
            match load(&label, &broken) {
                Ok(_) => panic!("{label}: section [{path}] accepted an unknown key"),
                Err(e) => assert!(e.to_string().contains("not_a_key"), "[{path}]: {e}"),
            }
        }
    }
    for section in ["", "postgres", "outbox", "outbox.columns", "kafka", "relay"] {
        assert!(checked.contains(section), "[{section}] was not checked");
    }
    for section in [
        "kafka.envelope",
        "kafka.cloudevents",
        "metrics",
        "traces",
        "retention",
    ] {
        assert!(checked.contains(section), "[{section}] was not checked");
    }
}

/// Every `section.key` of the example, its samples included, is on the
/// configuration page.
#[test]
fn every_key_of_the_example_is_on_the_configuration_page() {
    let mut all = BTreeSet::new();
    for (label, text) in example_variants() {
        let doc: toml::Table =
            toml::from_str(&text).unwrap_or_else(|e| panic!("{label}: {}", e.message()));
        keys(&doc, "", &mut all);
    }
    assert!(all.len() > 60, "only {} keys found", all.len());
    let missing: Vec<String> = all
        .iter()
        .filter(|(section, key)| !documented(CONFIGURATION_MD, section, key))
        .map(|(section, key)| format!("{section}.{key}"))
        .collect();
    assert!(
        missing.is_empty(),
        "keys of config/relay.example.toml without a row (or, for {PASS_THROUGH}, a \
         TOML example) in their section of docs/configuration.md: {missing:?}"
    );
}

#[test]
fn the_page_checks_are_not_vacuous() {
    assert!(documented(CONFIGURATION_MD, "relay", "max_attempts"));
    assert!(!documented(CONFIGURATION_MD, "relay", "max_atempts"));
    // A key of one section does not count for another.
    assert!(!documented(CONFIGURATION_MD, "log", "max_attempts"));
    assert!(documented(
        CONFIGURATION_MD,
        "kafka.producer",
        "ssl.ca.location"
    ));
    assert!(!documented(
        CONFIGURATION_MD,
        "kafka.producer",
        "ssl.ca.locaton"
    ));
    // A `# comment` in a code block is not a heading that ends a section.
    let page = "## `[a]`\n```toml\n# x\n```\n| `k` | 1 |\n## `[b]`\n| `j` | 2 |\n";
    assert!(documented(page, "a", "k"));
    assert!(!documented(page, "a", "j"));
}

#[test]
fn anchors_are_githubs() {
    for (title, anchor) in [
        (
            "Several outbox tables: `[[outbox]]`",
            "several-outbox-tables-outbox",
        ),
        (
            "PostgreSQL failover: synced slots (17+)",
            "postgresql-failover-synced-slots-17",
        ),
        (
            "`[outbox]` and `[outbox.columns]`",
            "outbox-and-outboxcolumns",
        ),
        (
            "Faults on purpose: `--control`",
            "faults-on-purpose---control",
        ),
    ] {
        assert_eq!(slug(title), anchor, "{title}");
    }
    let repeated = anchors("# A\n## A\n```\n# B\n```\n");
    assert_eq!(repeated, BTreeSet::from(["a".to_owned(), "a-1".to_owned()]));
}

/// Every relative link of the README and the docs leads to a file that exists
/// and, with an anchor, to one of its headings.
#[test]
fn links_between_the_documents_lead_somewhere() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in documents(root) {
        let text = std::fs::read_to_string(&doc).expect("read a document");
        let dir = doc.parent().expect("a document's folder");
        let name = doc.strip_prefix(root).unwrap_or(&doc).display().to_string();
        for (line, target) in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                doc.clone()
            } else {
                dir.join(path)
            };
            if !file.exists() {
                broken.push(format!("{name}:{line}: {target} (no such file)"));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if file.extension().is_none_or(|ext| ext != "md") {
                continue;
            }
            let target_text = std::fs::read_to_string(&file).expect("read a link's target");
            if !anchors(&target_text).contains(anchor) {
                broken.push(format!("{name}:{line}: {target} (no such heading)"));
            }
        }
    }
    assert!(checked > 100, "only {checked} links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
