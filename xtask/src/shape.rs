//! The agent's sources stay readable in one sitting: no function outside the tests longer than
//! 100 lines, and no file longer than 800 lines once its test module is left out. Checked by
//! `cargo test` (so by `cargo xtask test`) on `redirect-userspace/src`, read with `syn`.
use std::path::{Path, PathBuf};

use syn::{spanned::Spanned, visit::Visit};

use crate::layers::{is_test_file, is_test_only, rust_files};

const LONGEST_FUNCTION: usize = 100;
const LONGEST_FILE: usize = 800;

/// Lines spanned by `node`, first and last included.
fn lines_of(node: &impl Spanned) -> usize {
    let span = node.span();
    span.end().line + 1 - span.start().line
}

/// Functions outside test items, with their length; and the lines test items take.
#[derive(Default)]
struct Measure {
    functions: Vec<(String, usize, usize)>,
    test_lines: usize,
}

impl Measure {
    /// From `fn` to the closing brace: a function's docs and attributes do not count.
    fn function(&mut self, sig: &syn::Signature, body: &syn::Block) {
        let (start, end) = (sig.fn_token.span.start().line, body.span().end().line);
        self.functions
            .push((sig.ident.to_string(), start, end + 1 - start));
    }
}

impl<'ast> Visit<'ast> for Measure {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Const(i) => &i.attrs,
            _ => &Vec::new(),
        };
        if is_test_only(attrs) {
            self.test_lines += lines_of(item);
            return;
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.function(&f.sig, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_test_only(&f.attrs) {
            self.test_lines += lines_of(f);
            return;
        }
        self.function(&f.sig, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(body) = &f.default {
            self.function(&f.sig, body);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

/// Each function and file of `src` over its limit, said with where it is.
fn oversized(src: &Path) -> Result<Vec<String>, String> {
    let mut files = Vec::new();
    rust_files(src, &mut files).map_err(|e| format!("{}: {e}", src.display()))?;
    files.sort();
    let mut problems = Vec::new();
    for file in files {
        let relative: PathBuf = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
        if is_test_file(&relative) {
            continue;
        }
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        problems.extend(measure(&relative, &text)?);
    }
    Ok(problems)
}

fn measure(relative: &Path, text: &str) -> Result<Vec<String>, String> {
    let parsed = syn::parse_file(text).map_err(|e| format!("{}: {e}", relative.display()))?;
    let mut measure = Measure::default();
    measure.visit_file(&parsed);
    let mut problems = Vec::new();
    let lines = text.lines().count().saturating_sub(measure.test_lines);
    if lines > LONGEST_FILE {
        problems.push(format!(
            "{}: {lines} lines outside its tests (at most {LONGEST_FILE})",
            relative.display()
        ));
    }
    for (name, line, length) in measure.functions {
        if length > LONGEST_FUNCTION {
            problems.push(format!(
                "{}:{line}: fn {name} is {length} lines (at most {LONGEST_FUNCTION})",
                relative.display()
            ));
        }
    }
    Ok(problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_function_over_100_lines_and_no_file_over_800() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../redirect-userspace/src");
        let problems = oversized(&src).unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn a_long_function_is_named_and_test_items_do_not_count() {
        let body = "    let _ = 1;\n".repeat(LONGEST_FUNCTION);
        let source = format!(
            "//! doc\n/// Long.\nfn long() {{\n{body}}}\nfn short() {{}}\n#[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{body}    }}\n}}\n"
        );
        let problems = measure(Path::new("x.rs"), &source).unwrap();
        assert_eq!(problems, ["x.rs:3: fn long is 102 lines (at most 100)"]);
        let file = format!("//! doc\n{}", "const A: u8 = 0;\n".repeat(LONGEST_FILE));
        let problems = measure(Path::new("y.rs"), &file).unwrap();
        assert_eq!(
            problems,
            ["y.rs: 801 lines outside its tests (at most 800)"]
        );
    }
}
