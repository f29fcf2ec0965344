//! The repository's Markdown must hold together: every relative link in README.md, BENCHMARKS.md,
//! docs/*.md and the READMEs of examples/ and deploy/ names a file that exists and, with `#anchor`, a
//! heading of that file as GitHub names it; every docs/ section the code cites exists; and README.md
//! fits on a screen or two. Checked by `cargo test` (so by `cargo xtask test`).
//!
//! A small scanner rather than a Markdown crate: none is in the dependency tree, and what is checked
//! (link destinations, ATX and setext headings, fenced code, code spans, HTML comments) is a narrow,
//! stable part of CommonMark.
use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};

/// The most lines README.md may have: what it is, the two commands, the demo, how it works, the code
/// map and where to read on. Everything else belongs in docs/ or BENCHMARKS.md.
const README_MAX_LINES: usize = 250;

/// The Markdown files whose links are checked: the README, BENCHMARKS.md, every page of docs/, and the
/// READMEs of examples/ and deploy/.
fn checked_files(root: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = vec![
        root.join("README.md"),
        root.join("BENCHMARKS.md"),
        root.join("examples/README.md"),
        root.join("deploy/README.md"),
    ];
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "md") {
            docs.push(path);
        }
    }
    docs.sort();
    files.extend(docs);
    Ok(files)
}

/// A link destination as written, with the line it starts on (1-based).
#[derive(Debug, PartialEq)]
struct Link {
    line: usize,
    target: String,
}

/// Every problem with the links of `files`, one line each (`file:line: target: what is wrong`).
fn broken_links(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut anchors_by_file: HashMap<PathBuf, HashSet<String>> = HashMap::new();
    let mut problems = Vec::new();
    for file in files {
        let shown = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        let text = match std::fs::read_to_string(file) {
            Ok(text) => text,
            Err(err) => {
                problems.push(format!("{shown}: cannot be read: {err}"));
                continue;
            }
        };
        for link in links(&text) {
            if let Err(why) = check_link(root, file, &text, &link.target, &mut anchors_by_file) {
                problems.push(format!("{shown}:{}: {}: {why}", link.line, link.target));
            }
        }
    }
    problems
}

fn check_link(
    root: &Path,
    from: &Path,
    from_text: &str,
    target: &str,
    anchors_by_file: &mut HashMap<PathBuf, HashSet<String>>,
) -> Result<(), String> {
    if is_external(target) {
        return Ok(());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let resolved = if path.is_empty() {
        from.to_path_buf()
    } else if let Some(from_root) = path.strip_prefix('/') {
        normalize(&root.join(from_root))
    } else {
        normalize(&from.parent().unwrap_or(root).join(path))
    };
    if !resolved.exists() {
        return Err(format!("no such file ({})", resolved.display()));
    }
    let Some(anchor) = anchor else {
        return Ok(());
    };
    if resolved.extension().is_none_or(|ext| ext != "md") {
        // GitHub's line anchors into source files (`#L10`, `#L10-L20`) are the only others.
        return if is_line_anchor(anchor) {
            Ok(())
        } else {
            Err("an anchor into a file that is not Markdown".to_string())
        };
    }
    let key = resolved.clone();
    if !anchors_by_file.contains_key(&key) {
        let text = if path.is_empty() {
            from_text.to_string()
        } else {
            std::fs::read_to_string(&resolved)
                .map_err(|err| format!("cannot be read ({}): {err}", resolved.display()))?
        };
        anchors_by_file.insert(key.clone(), anchors(&text));
    }
    if anchors_by_file
        .get(&key)
        .is_some_and(|known| known.contains(anchor))
    {
        Ok(())
    } else {
        Err(format!(
            "no heading with the anchor #{anchor} in {}",
            resolved.display()
        ))
    }
}

/// `path` with its `.` and `..` components folded away, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir if out.file_name().is_some() => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Where the workspace's Rust sources cite a section of docs/ (`docs/<page>.md#<section>`): file, line
/// and the citation. Code comments cite the rules they carry out; the section must exist.
fn code_citations(root: &Path) -> std::io::Result<Vec<(PathBuf, usize, String)>> {
    let mut sources = Vec::new();
    rust_sources(root, &mut sources)?;
    sources.sort();
    let mut found = Vec::new();
    for file in sources {
        let text = std::fs::read_to_string(&file)?;
        for (number, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("docs/") {
                let candidate = &rest[at..];
                let len = candidate
                    .find(|c: char| {
                        !(c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '#' | '-' | '_'))
                    })
                    .unwrap_or(candidate.len());
                let cited = candidate[..len].trim_end_matches('.');
                if let Some((page, section)) = cited.split_once('#')
                    && page.ends_with(".md")
                    && !section.is_empty()
                {
                    found.push((file.clone(), number + 1, cited.to_string()));
                }
                rest = &candidate["docs/".len()..];
            }
        }
    }
    Ok(found)
}

/// Every `.rs` file under `dir`, build output and hidden folders left out.
fn rust_sources(dir: &Path, into: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type()?.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_sources(&path, into)?;
            }
        } else if name.ends_with(".rs") {
            into.push(path);
        }
    }
    Ok(())
}

fn is_external(target: &str) -> bool {
    target.contains("://") || target.starts_with("mailto:")
}

fn is_line_anchor(anchor: &str) -> bool {
    let line = |s: &str| {
        s.strip_prefix('L')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match anchor.split_once('-') {
        Some((first, last)) => line(first) && line(last),
        None => line(anchor),
    }
}

/// The document with what holds no links blanked out (fenced code blocks, HTML comments, code spans),
/// every newline kept so that offsets still tell the line.
fn prose(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fence: Option<(char, usize)> = None;
    for line in text.split_inclusive('\n') {
        let marker = fence_marker(line);
        match (fence, marker) {
            (None, Some(open)) => fence = Some(open),
            (Some((ch, len)), Some((close_ch, close_len)))
                if close_ch == ch
                    && close_len >= len
                    && line.trim_start().trim_start_matches(ch).trim().is_empty() =>
            {
                fence = None;
            }
            (None, None) => {
                out.push_str(line);
                continue;
            }
            _ => {}
        }
        out.push_str(&blank(line));
    }
    let out = blank_between(&out, "<!--", "-->");
    blank_code_spans(&out)
}

/// A line that opens or closes a fenced code block: its fence character and length.
fn fence_marker(line: &str) -> Option<(char, usize)> {
    let trimmed = line.trim_start();
    let ch = trimmed.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let len = trimmed.chars().take_while(|c| *c == ch).count();
    (len >= 3).then_some((ch, len))
}

/// `s` with every character but newlines replaced by a space.
fn blank(s: &str) -> String {
    s.chars()
        .map(|c| if c == '\n' { '\n' } else { ' ' })
        .collect()
}

/// `text` with everything from each `open` to the next `close` (both included) blanked.
fn blank_between(text: &str, open: &str, close: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        out.push_str(&rest[..start]);
        let after_open = &rest[start + open.len()..];
        let end = after_open
            .find(close)
            .map_or(rest.len(), |at| start + open.len() + at + close.len());
        out.push_str(&blank(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// `text` with each code span (a run of backticks to the next run of the same length) blanked; a run
/// with no closing run is literal text.
fn blank_code_spans(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|c| **c == '`').count();
        let close = (i + run..chars.len()).find(|&j| {
            chars[j] == '`'
                && (j == 0 || chars[j - 1] != '`')
                && chars[j..].iter().take_while(|c| **c == '`').count() == run
        });
        match close {
            Some(j) => {
                let span: String = chars[i..j + run].iter().collect();
                out.push_str(&blank(&span));
                i = j + run;
            }
            None => {
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// The destinations of the document's inline links and images (`[text](dest "title")`,
/// `![alt](<dest>)`) and of its link reference definitions (`[label]: dest`).
fn links(text: &str) -> Vec<Link> {
    let prose = prose(text);
    let chars: Vec<char> = prose.chars().collect();
    let mut line_of = Vec::with_capacity(chars.len());
    let mut line = 1;
    for c in &chars {
        line_of.push(line);
        if *c == '\n' {
            line += 1;
        }
    }
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '[' => {
                if let Some(close) = closing_bracket(&chars, i)
                    && let Some(target) = destination(&chars, close + 1)
                {
                    found.push(Link {
                        line: line_of[i],
                        target,
                    });
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    for (number, text) in prose.lines().enumerate() {
        if let Some(target) = reference_definition(text) {
            found.push(Link {
                line: number + 1,
                target,
            });
        }
    }
    found.sort_by_key(|link| link.line);
    found
}

/// The `]` that closes the `[` at `open`, nested brackets counted, within one paragraph.
fn closing_bracket(chars: &[char], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = open;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 1,
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            '\n' if chars.get(i + 1).is_some_and(|c| *c == '\n') => return None,
            _ => {}
        }
        i += 1;
    }
    None
}

/// The destination of `(dest "title")` starting at `at`, if a link's parenthesis starts there.
fn destination(chars: &[char], at: usize) -> Option<String> {
    if chars.get(at) != Some(&'(') {
        return None;
    }
    let mut i = at + 1;
    while chars.get(i).is_some_and(|c| *c == ' ' || *c == '\n') {
        i += 1;
    }
    if chars.get(i) == Some(&'<') {
        let end = (i + 1..chars.len()).find(|&j| chars[j] == '>' || chars[j] == '\n')?;
        return (chars[end] == '>').then(|| chars[i + 1..end].iter().collect());
    }
    let start = i;
    let mut depth = 0usize;
    while let Some(&c) = chars.get(i) {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => break,
            ')' => depth -= 1,
            c if c.is_whitespace() => break,
            _ => {}
        }
        i += 1;
    }
    let target: String = chars[start..i].iter().collect();
    // What follows the destination must be a title or the closing parenthesis.
    let mut rest = chars[i..].iter().skip_while(|c| **c == ' ' || **c == '\n');
    match rest.next() {
        Some(')') | Some('"') | Some('\'') => (!target.is_empty()).then_some(target),
        _ => None,
    }
}

/// `[label]: dest` at the start of a line (up to three spaces in).
fn reference_definition(line: &str) -> Option<String> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let rest = line
        .trim_start_matches(' ')
        .strip_prefix('[')
        .filter(|_| indent <= 3)?;
    let (label, after) = rest.split_once("]:")?;
    if label.is_empty() || label.contains('[') {
        return None;
    }
    let dest = after.split_whitespace().next()?;
    let dest = dest
        .strip_prefix('<')
        .and_then(|d| d.strip_suffix('>'))
        .unwrap_or(dest);
    Some(dest.to_string())
}

/// The anchors GitHub gives the document's headings.
fn anchors(text: &str) -> HashSet<String> {
    let mut slugger = Slugger::default();
    headings(text)
        .iter()
        .map(|heading| slugger.slug(heading))
        .collect()
}

/// The text of each heading, in order: ATX (`## Title ##`) and setext (`Title` over `===` or `---`),
/// outside fenced code.
fn headings(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    let mut previous: Option<&str> = None;
    for line in text.lines() {
        if let Some((ch, len)) = fence {
            if fence_marker(line).is_some_and(|(c, l)| c == ch && l >= len)
                && line.trim_start().trim_start_matches(ch).trim().is_empty()
            {
                fence = None;
            }
            previous = None;
            continue;
        }
        if let Some(open) = fence_marker(line) {
            fence = Some(open);
            previous = None;
            continue;
        }
        if let Some(heading) = atx_heading(line) {
            found.push(heading);
            previous = None;
            continue;
        }
        let underline = line.trim();
        let is_underline = !underline.is_empty()
            && (underline.chars().all(|c| c == '=') || underline.chars().all(|c| c == '-'));
        if is_underline && let Some(title) = previous.filter(|p| is_paragraph_line(p)) {
            found.push(render_inline(title.trim()));
            previous = None;
            continue;
        }
        previous = (!line.trim().is_empty()).then_some(line);
    }
    found
}

fn atx_heading(line: &str) -> Option<String> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let trimmed = line.trim_start_matches(' ');
    let level = trimmed.chars().take_while(|c| *c == '#').count();
    if !(1..=6).contains(&level) {
        return None;
    }
    let rest = &trimmed[level..];
    if !rest.is_empty() && !rest.starts_with([' ', '\t']) {
        return None;
    }
    let mut content = rest.trim();
    // A closing sequence of `#`s is not part of the heading when a space precedes it.
    let without_closing = content.trim_end_matches('#');
    if without_closing.is_empty() || without_closing.ends_with([' ', '\t']) {
        content = without_closing.trim_end();
    }
    Some(render_inline(content))
}

/// A line that can be a setext heading's text: not a list item, quote, table row or HTML block.
fn is_paragraph_line(line: &str) -> bool {
    let trimmed = line.trim_start();
    let list_item = trimmed.starts_with(['-', '*', '+'])
        || trimmed
            .split_once(['.', ')'])
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    line.len() - trimmed.len() <= 3 && !list_item && !trimmed.starts_with(['>', '|', '<'])
}

/// A heading's text as rendered: code spans keep their content, links and images their text, and
/// backslash escapes their character.
fn render_inline(markdown: &str) -> String {
    let chars: Vec<char> = markdown.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if chars.get(i + 1).is_some_and(|c| c.is_ascii_punctuation()) => {
                out.push(chars[i + 1]);
                i += 2;
            }
            '`' => {
                let run = chars[i..].iter().take_while(|c| **c == '`').count();
                let close = (i + run..chars.len()).find(|&j| {
                    chars[j] == '`'
                        && chars[j - 1] != '`'
                        && chars[j..].iter().take_while(|c| **c == '`').count() == run
                });
                match close {
                    Some(j) => {
                        let code: String = chars[i + run..j].iter().collect();
                        out.push_str(&code);
                        i = j + run;
                    }
                    None => {
                        out.extend(&chars[i..i + run]);
                        i += run;
                    }
                }
            }
            '!' if chars.get(i + 1) == Some(&'[') => i += 1,
            '[' => match closing_bracket(&chars, i) {
                Some(close) if chars.get(close + 1) == Some(&'(') => {
                    let end = (close + 1..chars.len())
                        .find(|&j| chars[j] == ')')
                        .unwrap_or(chars.len() - 1);
                    out.push_str(&render_inline(
                        &chars[i + 1..close].iter().collect::<String>(),
                    ));
                    i = end + 1;
                }
                _ => {
                    out.push('[');
                    i += 1;
                }
            },
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// GitHub's heading anchors (github-slugger): lower case; every character but letters, digits,
/// marks, `-`, `_` and spaces dropped; each space a `-`; a repeated anchor gets `-1`, `-2`, ...
#[derive(Default)]
struct Slugger {
    seen: HashMap<String, usize>,
}

impl Slugger {
    fn slug(&mut self, heading: &str) -> String {
        let base: String = heading
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                '-' | '_' => Some(c),
                c if c.is_alphanumeric() || is_combining_mark(c) => Some(c),
                _ => None,
            })
            .collect();
        let mut slug = base.clone();
        while self.seen.contains_key(&slug) {
            let count = self.seen.entry(base.clone()).or_insert(0);
            *count += 1;
            slug = format!("{base}-{count}");
        }
        self.seen.insert(slug.clone(), 0);
        slug
    }
}

/// Combining diacritical marks, which GitHub keeps in anchors (the common blocks).
fn is_combining_mark(c: char) -> bool {
    matches!(c, '\u{0300}'..='\u{036F}' | '\u{1AB0}'..='\u{1AFF}' | '\u{1DC0}'..='\u{1DFF}' | '\u{20D0}'..='\u{20FF}' | '\u{FE20}'..='\u{FE2F}')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::workspace_root;

    #[test]
    fn every_link_in_the_readmes_benchmarks_and_docs_resolves() {
        let root = workspace_root();
        let files = checked_files(&root).expect("docs/ can be listed");
        let problems = broken_links(&root, &files);
        assert!(
            problems.is_empty(),
            "broken links:\n{}",
            problems.join("\n")
        );
    }

    #[test]
    fn every_docs_section_cited_by_the_code_exists() {
        let root = workspace_root();
        let citations = code_citations(&root).expect("the sources can be read");
        // This file's own examples are not citations.
        let this_file = root.join(file!());
        let mut anchors_by_file = HashMap::new();
        let problems: Vec<String> = citations
            .iter()
            .filter(|(file, _, _)| *file != this_file)
            .filter_map(|(file, line, cited)| {
                // Citations are written from the workspace root.
                let from_root = root.join("Cargo.toml");
                check_link(&root, &from_root, "", cited, &mut anchors_by_file)
                    .err()
                    .map(|why| {
                        let shown = file.strip_prefix(&root).unwrap_or(file).display();
                        format!("{shown}:{line}: {cited}: {why}")
                    })
            })
            .collect();
        assert!(
            citations.len() > 10,
            "the scan found only {} citations",
            citations.len()
        );
        assert!(
            problems.is_empty(),
            "sections cited by the code that do not exist:\n{}",
            problems.join("\n")
        );
    }

    #[test]
    fn readme_fits_on_a_screen() {
        let text = std::fs::read_to_string(workspace_root().join("README.md"))
            .expect("README.md is readable");
        let lines = text.lines().count();
        assert!(
            lines <= README_MAX_LINES,
            "README.md has {lines} lines, at most {README_MAX_LINES}: move the detail to docs/ and link it"
        );
    }

    #[test]
    fn anchors_follow_githubs_rules() {
        let mut slugger = Slugger::default();
        assert_eq!(slugger.slug("Answer cache"), "answer-cache");
        assert_eq!(
            slugger.slug("6. The cluster as the source (`run --kube`) at scale"),
            "6-the-cluster-as-the-source-run---kube-at-scale"
        );
        assert_eq!(
            slugger.slug("4. DNS (dnsperf, UDP): queries/s with 64 outstanding; mean latency with 1 outstanding, µs"),
            "4-dns-dnsperf-udp-queriess-with-64-outstanding-mean-latency-with-1-outstanding-µs"
        );
        assert_eq!(
            slugger.slug("Headline: ratio to direct (min–max, 0.9×)"),
            "headline-ratio-to-direct-minmax-09"
        );
        assert_eq!(slugger.slug("snake_case and CAPS"), "snake_case-and-caps");
        // Repeats are numbered, and a numbered anchor already taken is skipped.
        assert_eq!(slugger.slug("Kernels"), "kernels");
        assert_eq!(slugger.slug("Kernels"), "kernels-1");
        assert_eq!(slugger.slug("Kernels 1"), "kernels-1-1");
        assert_eq!(slugger.slug("Kernels"), "kernels-2");
    }

    #[test]
    fn headings_are_read_as_rendered() {
        let text = "# Title #\n\n## A [link](x.md) and `code_span`\n\n```\n# not a heading\n```\n\nSetext\n======\n\n- item\n---\n#hashtag\n";
        assert_eq!(headings(text), ["Title", "A link and code_span", "Setext"]);
        assert_eq!(
            anchors(text),
            HashSet::from([
                "title".to_string(),
                "a-link-and-code_span".to_string(),
                "setext".to_string()
            ])
        );
    }

    #[test]
    fn links_are_found_outside_code_only() {
        let text = "See [docs](docs/README.md) and ![chart](docs/chart.png \"title\").\n\
                    `[not](a-link.md)` <!-- [nor](this.md) -->\n\
                    ```\n[nor](fenced.md)\n```\n\
                    [nested [brackets]](<with space.md>) [web](https://example.com) \\[escaped](no.md)\n\
                    [a link\nover two lines](two.md#part) [not a link] (gap.md)\n\
                    [ref]: docs/ref.md\n";
        let targets: Vec<(usize, String)> = links(text)
            .into_iter()
            .map(|l| (l.line, l.target))
            .collect();
        assert_eq!(
            targets,
            [
                (1, "docs/README.md".to_string()),
                (1, "docs/chart.png".to_string()),
                (6, "with space.md".to_string()),
                (6, "https://example.com".to_string()),
                (7, "two.md#part".to_string()),
                (9, "docs/ref.md".to_string()),
            ]
        );
    }

    #[test]
    fn a_broken_file_or_anchor_is_reported_with_where_it_is() {
        let dir = std::env::temp_dir().join(format!("xtask-doc-links-{}", std::process::id()));
        let docs = dir.join("docs");
        std::fs::create_dir_all(&docs).expect("temp dir");
        std::fs::write(
            dir.join("README.md"),
            "# Top\n\n[ok](docs/a.md#the-part) [gone](docs/missing.md)\n[bad anchor](docs/a.md#no-such-part)\n[here](#top) [not here](#elsewhere) [src](docs/a.rs#L3-L5)\n",
        )
        .expect("write");
        std::fs::write(docs.join("a.md"), "# A\n\n## The part\n").expect("write");
        std::fs::write(docs.join("a.rs"), "").expect("write");
        let problems = broken_links(&dir, &[dir.join("README.md")]);
        std::fs::remove_dir_all(&dir).expect("clean up");
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(
            problems[0].starts_with("README.md:3: docs/missing.md: no such file"),
            "{}",
            problems[0]
        );
        assert!(
            problems[1].starts_with("README.md:4: docs/a.md#no-such-part: no heading"),
            "{}",
            problems[1]
        );
        assert!(
            problems[2].starts_with("README.md:5: #elsewhere: no heading"),
            "{}",
            problems[2]
        );
    }
}
