//! Static rules from a text file, in the golden corpus's `match`/`rule` line format:
//!
//! ```text
//! # reflect the echo flow
//! match 100 udp 198.19.10.2:40000 > 198.19.10.9:7
//! rule decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:40000; encap 198.18.0.2 vni 100; out 0
//! ```
//!
//! Each `match` line is followed by exactly one `rule` line. `#` starts a comment line;
//! blank lines are ignored.

use std::collections::HashMap;

use pipeline::{parse_actions, FlowKey, Rule, RuleError};
use thiserror::Error;

/// A rule and the line of its `match`, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticRule {
    pub line: usize,
    pub rule: Rule,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RulesFileError {
    /// The line does not parse (the error is in the message, not a `source()`, so
    /// error chains print it once).
    #[error("line {line}: {error}")]
    Rule { line: usize, error: RuleError },
    #[error("line {line}: `rule` without a `match` line before it")]
    RuleWithoutMatch { line: usize },
    #[error("line {line}: `match` without a `rule` line after it")]
    MatchWithoutRule { line: usize },
    #[error("line {line}: the same match as line {first}")]
    Duplicate { line: usize, first: usize },
    #[error("line {line}: expected `match ...`, `rule ...` or a `#` comment, got {text:?}")]
    Unknown { line: usize, text: String },
}

/// Parse a rules file. Rules come back in file order; a key may appear only once.
pub fn parse_rules(text: &str) -> Result<Vec<StaticRule>, RulesFileError> {
    let mut out = Vec::new();
    let mut seen: HashMap<FlowKey, usize> = HashMap::new();
    let mut pending: Option<(usize, FlowKey)> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let (word, rest) = l.split_once(char::is_whitespace).unwrap_or((l, ""));
        match word {
            "match" => {
                if let Some((m, _)) = pending {
                    return Err(RulesFileError::MatchWithoutRule { line: m });
                }
                let key: FlowKey = rest
                    .parse()
                    .map_err(|error| RulesFileError::Rule { line, error })?;
                if let Some(&first) = seen.get(&key) {
                    return Err(RulesFileError::Duplicate { line, first });
                }
                seen.insert(key, line);
                pending = Some((line, key));
            }
            "rule" => {
                let Some((m, key)) = pending.take() else {
                    return Err(RulesFileError::RuleWithoutMatch { line });
                };
                let actions =
                    parse_actions(rest).map_err(|error| RulesFileError::Rule { line, error })?;
                out.push(StaticRule {
                    line: m,
                    rule: Rule::new(key, actions),
                });
            }
            _ => {
                return Err(RulesFileError::Unknown {
                    line,
                    text: l.to_string(),
                })
            }
        }
    }
    if let Some((m, _)) = pending {
        return Err(RulesFileError::MatchWithoutRule { line: m });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_and_skips_comments() {
        let text = "\
# a comment

match 100 udp 198.19.10.2:40000 > 198.19.10.9:7
rule decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:40000; encap 198.18.0.2 vni 100; out 0
  # indented comment
match 5 tcp [2001:2::1]:80 > [2001:2::2]:443
rule drop acl-deny
";
        let r = parse_rules(text).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].line, 3);
        assert_eq!(
            r[0].rule.key,
            "100 udp 198.19.10.2:40000 > 198.19.10.9:7"
                .parse::<FlowKey>()
                .unwrap()
        );
        assert_eq!(
            pipeline::format_actions(&r[0].rule.actions),
            "decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:40000; encap 198.18.0.2 vni 100; out 0"
        );
        assert_eq!(r[1].line, 6);
        assert_eq!(parse_rules("").unwrap(), vec![]);
    }

    #[test]
    fn errors_name_the_line() {
        let e = |t: &str| parse_rules(t).unwrap_err();
        assert_eq!(
            e("rule out 0"),
            RulesFileError::RuleWithoutMatch { line: 1 }
        );
        assert_eq!(
            e("match 1 udp 1.2.3.4:1 > 1.2.3.5:2\n"),
            RulesFileError::MatchWithoutRule { line: 1 }
        );
        assert_eq!(
            e("match 1 udp 1.2.3.4:1 > 1.2.3.5:2\nmatch 1 udp 1.2.3.4:1 > 1.2.3.5:3\nrule out 0"),
            RulesFileError::MatchWithoutRule { line: 1 }
        );
        assert_eq!(
            e("match 1 udp 1.2.3.4:1 > 1.2.3.5:2\nrule out 0\n\nmatch 1 udp 1.2.3.4:1 > 1.2.3.5:2"),
            RulesFileError::Duplicate { line: 4, first: 1 }
        );
        assert!(matches!(
            e("\n\nmatch 1 udp x > y"),
            RulesFileError::Rule { line: 3, .. }
        ));
        assert!(matches!(
            e("match 1 udp 1.2.3.4:1 > 1.2.3.5:2\nrule frobnicate"),
            RulesFileError::Rule { line: 2, .. }
        ));
        assert!(matches!(
            e("node ip=1.2.3.4"),
            RulesFileError::Unknown { line: 1, .. }
        ));
    }
}
