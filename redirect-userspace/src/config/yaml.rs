//! YAML text -> documents, with the work bounded before and during parsing.
//!
//! The parser underneath slows down quadratically with flow nesting (`[[[[…` or `{a: {a: …`): 100 KB
//! of `[` alone takes seconds. So a cheap scan refuses text nested deeper than [`MAX_DEPTH`] before
//! the parser sees it. Aliases are expanded into a budget of bytes (not a count of aliases), so a
//! small file that would expand into gigabytes is refused as soon as it passes the budget.
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Visitor};
use serde_yaml_ng::{
    Mapping, Number, Value,
    value::{Tag, TaggedValue},
};

/// The deepest nesting accepted. The deserializer refuses past 128 levels anyway; Kubernetes
/// objects nest about 10 deep.
pub(super) const MAX_DEPTH: usize = 128;
/// What one node costs in the expansion budget on top of its text.
const NODE_COST: usize = 16;

/// Hands `each` every document of `text` in order, parsed into a value of at most `budget` bytes
/// (expanded through its aliases), as soon as it is parsed: only one document's tree is held at a
/// time, so a file of 10,000 objects never holds 10,000 trees at once. After the first error the
/// rest of the text is lost: the parser cannot resynchronise, so the error is the last call.
pub(super) fn for_each_document(
    text: &str,
    budget: usize,
    mut each: impl FnMut(Result<Value, String>),
) {
    if let Err(e) = check_nesting(text) {
        return each(Err(e));
    }
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        let remaining = Cell::new(budget);
        match (Build {
            remaining: &remaining,
            budget,
        })
        .deserialize(document)
        {
            Ok(value) => each(Ok(value)),
            Err(e) => return each(Err(e.to_string())),
        }
    }
}

/// Refuses text whose flow collections nest deeper than [`MAX_DEPTH`], in one pass.
///
/// It skips what cannot nest (quoted text, comments, block scalars) only where the parser surely
/// would; anywhere else it counts, erring towards refusing, which only matters past [`MAX_DEPTH`]
/// unbalanced brackets. A quote is followed to the end of its line at most, so a stray quote never
/// hides the lines after it.
fn check_nesting(text: &str) -> Result<(), String> {
    let bytes = text.as_bytes();
    let mut scan = Scan {
        depth: 0,
        line: 1,
        block_scalar: None,
        node_col: 0,
    };
    let mut i = 0;
    // The last byte on this line that is not a space, if any.
    let mut prev: Option<u8> = None;
    let mut at_line_start = true;
    while i < bytes.len() {
        if at_line_start {
            prev = None;
            match scan.line_start(bytes, i) {
                LineStart::Text(next) => i = next,
                LineStart::End => break,
                LineStart::Node(next) => {
                    at_line_start = false;
                    i = next;
                }
            }
            continue;
        }
        let b = bytes[i];
        // Where a new node may start: a quote or a block scalar indicator there is one.
        let node_start = matches!(prev, None | Some(b':' | b'-' | b'?' | b'[' | b'{' | b','));
        let after_space = i == 0 || matches!(bytes[i - 1], b' ' | b'\t' | b'\n');
        match b {
            b'\n' => {
                scan.line += 1;
                at_line_start = true;
            }
            b'#' if after_space => {
                i += bytes[i..]
                    .iter()
                    .position(|&b| b == b'\n')
                    .unwrap_or(bytes.len() - i);
                continue;
            }
            b'"' | b'\'' if node_start => {
                i += quoted_end(&bytes[i..], b);
                prev = Some(b);
                continue;
            }
            b'[' | b'{' if after_space || scan.depth > 0 || node_start => {
                scan.depth += 1;
                if scan.depth > MAX_DEPTH {
                    return Err(format!(
                        "nested deeper than {MAX_DEPTH} levels at line {}: refused before parsing",
                        scan.line
                    ));
                }
            }
            b']' | b'}' => scan.depth = scan.depth.saturating_sub(1),
            b'|' | b'>' if node_start && scan.depth == 0 => {
                let after = &bytes[i + 1..];
                let header = after
                    .iter()
                    .take_while(|&&b| matches!(b, b'-' | b'+' | b'0'..=b'9'))
                    .count();
                if after[header..]
                    .first()
                    .is_none_or(|&b| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'#'))
                {
                    scan.block_scalar = Some((scan.node_col, None));
                }
            }
            // Inside a plain scalar (`a: x[0]`): text, and so is what follows it.
            b'[' | b'{' => {
                prev = Some(b'x');
                i += 1;
                continue;
            }
            _ => {}
        }
        if !matches!(b, b' ' | b'\t' | b'\n') {
            prev = Some(b);
        }
        i += 1;
    }
    Ok(())
}

/// Where the scan of [`check_nesting`] is: the nesting so far and what the current line opened.
struct Scan {
    depth: usize,
    line: usize,
    /// An open block scalar (`key: |`): the column of the node that opened it, and the
    /// indentation of its first line of text once seen. Lines at that indentation or deeper are
    /// its text.
    block_scalar: Option<(usize, Option<usize>)>,
    /// The column where this line's node starts, after indentation and `- ` indicators.
    node_col: usize,
}

/// What the start of a line turned out to be.
enum LineStart {
    /// Text of an open block scalar, skipped whole: the next line starts here.
    Text(usize),
    /// The last line was block scalar text.
    End,
    /// A line of nodes, scanned from here (past its indentation).
    Node(usize),
}

impl Scan {
    fn line_start(&mut self, bytes: &[u8], i: usize) -> LineStart {
        let indent = bytes[i..].iter().take_while(|&&b| b == b' ').count();
        let rest = &bytes[i + indent..];
        let blank = rest.first().is_none_or(|&b| b == b'\n' || b == b'\r');
        if let Some((parent, text_indent)) = self.block_scalar {
            let text_indent = if blank {
                text_indent
            } else {
                text_indent.or(Some(indent))
            };
            if blank || indent > parent && Some(indent) >= text_indent {
                self.block_scalar = Some((parent, text_indent));
                return match rest.iter().position(|&b| b == b'\n') {
                    Some(n) => {
                        self.line += 1;
                        LineStart::Text(i + indent + n + 1)
                    }
                    None => LineStart::End,
                };
            }
            self.block_scalar = None;
        }
        // A document marker (the parser stops at one inside an open collection) starts afresh.
        let marker = rest.starts_with(b"---") || rest.starts_with(b"...");
        if indent == 0
            && marker
            && rest
                .get(3)
                .is_none_or(|&b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        {
            self.depth = 0;
        }
        self.node_col = indent;
        while bytes.get(i + self.node_col) == Some(&b'-')
            && bytes.get(i + self.node_col + 1) == Some(&b' ')
        {
            self.node_col += 1;
            self.node_col += bytes[i + self.node_col..]
                .iter()
                .take_while(|&&b| b == b' ')
                .count();
        }
        LineStart::Node(i + indent)
    }
}

/// How far a quoted scalar starting at `bytes[0]` runs: just past its closing quote, or to the end
/// of its line (the newline itself is left to the caller).
fn quoted_end(bytes: &[u8], quote: u8) -> usize {
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => return i,
            b'\\' if quote == b'"' && bytes.get(i + 1) != Some(&b'\n') => i += 1,
            b'\'' if quote == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
            q if q == quote => return i + 1,
            _ => {}
        }
        i += 1;
    }
    bytes.len()
}

/// Builds a [`Value`] while charging every node, and every byte of text, to a shared budget.
/// Aliases are replayed by the deserializer, so expanded copies are charged too.
#[derive(Clone, Copy)]
struct Build<'a> {
    remaining: &'a Cell<usize>,
    budget: usize,
}

impl Build<'_> {
    fn charge<E: de::Error>(&self, text: usize) -> Result<(), E> {
        let cost = NODE_COST.saturating_add(text);
        match self.remaining.get().checked_sub(cost) {
            Some(left) => {
                self.remaining.set(left);
                Ok(())
            }
            None => Err(E::custom(format!(
                "the document expands (through YAML aliases) past {} bytes: refused",
                self.budget
            ))),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Build<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Build<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.charge(0)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.charge(0)?;
        Ok(Value::Number(Number::from(v)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.charge(0)?;
        Ok(Value::Number(Number::from(v)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.charge(0)?;
        Ok(Value::Number(Number::from(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.charge(v.len())?;
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.charge(v.len())?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.charge(0)?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.charge(0)?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Sequence(items))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.charge(0)?;
        let mut mapping = Mapping::new();
        while let Some(key) = map.next_key_seed(self)? {
            // A repeated key is an error, as serde_yaml_ng's own Value makes it.
            if mapping.contains_key(&key) {
                let shown = match &key {
                    Value::String(s) => format!("{:?}", super::error::bounded(s, 64)),
                    _ => "that is not a string".into(),
                };
                return Err(de::Error::custom(format!(
                    "duplicate key {shown} in a mapping"
                )));
            }
            let value = map.next_value_seed(self)?;
            mapping.insert(key, value);
        }
        Ok(Value::Mapping(mapping))
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        // A custom tag (`!thing value`): kept as a tagged value, as serde_yaml_ng's own Value does.
        use de::VariantAccess;
        let (tag, variant): (String, _) = data.variant()?;
        self.charge(tag.len())?;
        let value = variant.newtype_variant_seed(self)?;
        Ok(Value::Tagged(Box::new(TaggedValue {
            tag: Tag::new(tag),
            value,
        })))
    }
}

/// A value parsed from one piece of text (the `mesh` key of a ConfigMap) under the same bounds.
pub(super) fn single(text: &str, budget: usize) -> Result<Value, String> {
    check_nesting(text)?;
    let remaining = Cell::new(budget);
    Build {
        remaining: &remaining,
        budget,
    }
    .deserialize(serde_yaml_ng::Deserializer::from_str(text))
    .map_err(|e| e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    const BUDGET: usize = 1 << 20;

    /// Every document of `text`, collected.
    pub(crate) fn documents(text: &str, budget: usize) -> Vec<Result<Value, String>> {
        let mut out = Vec::new();
        for_each_document(text, budget, |d| out.push(d));
        out
    }

    fn first(text: &str) -> Result<Value, String> {
        documents(text, BUDGET)
            .into_iter()
            .next()
            .unwrap_or(Ok(Value::Null))
    }

    #[test]
    fn nesting_rules() {
        struct Case {
            name: &'static str,
            text: String,
            refused: bool,
        }
        let deep = |open: &str, n: usize| open.repeat(n);
        let cases = [
            Case {
                name: "100 KB of [ is refused",
                text: deep("[", 100_000),
                refused: true,
            },
            Case {
                name: "deep flow mappings are refused",
                text: deep("{a: ", 100_000),
                refused: true,
            },
            Case {
                name: "balanced nesting at the limit loads",
                text: format!("{}1{}", deep("[", 100), deep("]", 100)),
                refused: false,
            },
            Case {
                name: "brackets inside quotes do not count",
                text: format!("a: \"{}\"\nb: '{}'\n", deep("[", 500), deep("{", 500)),
                refused: false,
            },
            Case {
                name: "brackets inside a block scalar do not count",
                text: format!("a: |\n  {}\n  more\nb: 1\n", deep("[", 500)),
                refused: false,
            },
            Case {
                name: "brackets in a comment do not count",
                text: format!("a: 1 # {}\n", deep("[", 500)),
                refused: false,
            },
            Case {
                name: "brackets inside a plain scalar do not count",
                text: format!("a: x{}\n", deep("[", 500)),
                refused: false,
            },
            Case {
                name: "each document starts from zero",
                text: format!("a: x [{}\n---\nb: {}\n", deep("[", 100), deep("[", 100)),
                refused: false,
            },
            Case {
                name: "text that only looks like a marker does not reset",
                text: format!("{}\n...x\n{}\n", deep("[", 100), deep("[", 100)),
                refused: true,
            },
            Case {
                name: "a line less indented than the block scalar's text ends it",
                text: format!("a: |\n    text\n  {}\n", deep("[", 500)),
                refused: true,
            },
            Case {
                name: "a bracket after a block scalar counts again",
                text: format!("a: |\n  text\nb: {}\n", deep("[", 500)),
                refused: true,
            },
        ];
        for case in cases {
            let got = check_nesting(&case.text);
            assert_eq!(got.is_err(), case.refused, "{}: {got:?}", case.name);
        }
    }

    #[test]
    fn pathological_text_is_refused_fast() {
        let bomb = alias_bomb();
        for (name, text) in [
            ("brackets", "[".repeat(100_000)),
            ("flow mappings", "{a: ".repeat(100_000)),
            ("block sequences", format!("{}1\n", "- ".repeat(100_000))),
            ("alias bomb", bomb),
        ] {
            let started = Instant::now();
            let got = first(&text);
            assert!(got.is_err(), "{name}: loaded");
            // A bound, not a timing claim: the unbounded parser took seconds to minutes here.
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{name}: {:?}",
                started.elapsed()
            );
        }
    }

    /// Nine levels of nine aliases each: 350 bytes that expand to 9^9 strings.
    pub(crate) fn alias_bomb() -> String {
        let mut text = String::from(
            "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
        );
        for level in 1..9u8 {
            let (name, prev) = ((b'a' + level) as char, (b'a' + level - 1) as char);
            let refs = vec![format!("*{prev}"); 9].join(",");
            text.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        text
    }

    #[test]
    fn expansion_is_bounded_by_bytes() {
        let err = first(&alias_bomb()).unwrap_err();
        assert!(err.contains("expands"), "{err}");
        // A modest use of aliases stays well inside the budget.
        let ok = first("base: &b {x: 1, y: [a, b]}\none: *b\ntwo: *b\n").unwrap();
        assert_eq!(ok["two"]["y"][1], Value::String("b".into()));
    }

    #[test]
    fn documents_keep_their_order_and_stop_at_a_syntax_error() {
        let docs = documents("a: 1\n---\nb: [\n---\nc: 3\n", BUDGET);
        assert_eq!(docs.len(), 2, "{docs:?}");
        assert!(docs[0].is_ok() && docs[1].is_err(), "{docs:?}");
    }

    #[test]
    fn a_repeated_key_is_an_error() {
        let err = first("a: 1\na: 2\n").unwrap_err();
        assert!(err.contains("duplicate key \"a\""), "{err}");
    }

    #[test]
    fn tags_are_kept() {
        let v = first("a: !custom 5\nb: !!str 7\n").unwrap();
        assert!(matches!(&v["a"], Value::Tagged(_)), "{v:?}");
        assert_eq!(v["b"], Value::String("7".into()));
    }
}
