//! The agent's modules stand in layers, listed top to bottom in the README's code map (the line
//! that starts with `**Layers**`): a module may import from the layers below its own, never from
//! its own layer's other modules or from a layer above. Checked by `cargo test` (so by `cargo xtask
//! test`) on every non-test item of `redirect-userspace/src`: `use crate::...` trees and every
//! `crate::...` path in code. Every `.rs` file there must also open with a `//!` module doc.
//!
//! The sources are read with `syn`, so that a path inside a comment, a string or a test module does
//! not count.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use syn::visit::Visit;

/// The layers as the README lists them, top first: layers apart by `›`, a layer's modules by `,`.
fn layers(readme: &str) -> Result<Vec<Vec<String>>, String> {
    let line = readme
        .lines()
        .find(|l| l.starts_with("**Layers**"))
        .ok_or("README.md has no line starting with **Layers**")?;
    let list = line.split_once(':').map_or(line, |(_, list)| list);
    let layers: Vec<Vec<String>> = list
        .split('›')
        .map(|layer| {
            layer
                .split(',')
                .filter_map(|name| {
                    let name = name.trim().trim_end_matches('.');
                    let name = name.strip_prefix('`')?.strip_suffix('`')?;
                    Some(name.to_string())
                })
                .collect()
        })
        .collect();
    match layers.iter().all(|l| !l.is_empty()) && layers.len() > 1 {
        true => Ok(layers),
        false => Err(format!("README.md's layer line lists no layers: {line}")),
    }
}

/// Where one module's import of another is.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Import {
    from: String,
    to: String,
    file: PathBuf,
}

/// Collects the first segment after `crate::` of every path outside test items.
struct Imports<'a> {
    module: &'a str,
    found: BTreeSet<String>,
}

pub(crate) fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

impl Imports<'_> {
    fn note(&mut self, name: &syn::Ident) {
        let name = name.to_string();
        if name != self.module && name != "self" {
            self.found.insert(name);
        }
    }

    fn tree(&mut self, tree: &syn::UseTree, under_crate: bool) {
        match tree {
            syn::UseTree::Path(p) if under_crate => self.note(&p.ident),
            syn::UseTree::Path(p) if p.ident == "crate" => self.tree(&p.tree, true),
            syn::UseTree::Name(n) if under_crate => self.note(&n.ident),
            syn::UseTree::Rename(r) if under_crate => self.note(&r.ident),
            syn::UseTree::Group(g) => {
                for item in &g.items {
                    self.tree(item, under_crate);
                }
            }
            _ => {}
        }
    }
}

impl<'ast> Visit<'ast> for Imports<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if !is_test_only(attrs) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_only(&f.attrs) {
            syn::visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.tree(&item.tree, false);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let mut segments = path.segments.iter();
        if segments.next().is_some_and(|s| s.ident == "crate")
            && let Some(next) = segments.next()
        {
            self.note(&next.ident);
        }
        syn::visit::visit_path(self, path);
    }
}

/// Whether `path` (relative to `src/`) holds only tests: a `tests.rs`, a `*_tests.rs` or a file
/// under `tests/`.
pub(crate) fn is_test_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == "tests.rs" || n.ends_with("_tests.rs"))
        || path.components().any(|c| c.as_os_str() == "tests")
}

pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Every file of `src` without a `//!` doc, and every import between top-level modules.
fn scan(src: &Path) -> Result<(Vec<PathBuf>, Vec<Import>), String> {
    let mut files = Vec::new();
    rust_files(src, &mut files).map_err(|e| format!("{}: {e}", src.display()))?;
    files.sort();
    let mut undocumented = Vec::new();
    let mut imports = Vec::new();
    for file in files {
        let relative = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        if !text.trim_start().starts_with("//!") {
            undocumented.push(relative.clone());
        }
        let module = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|c| c.trim_end_matches(".rs").to_string())
            .unwrap_or_default();
        if module == "lib" || module == "main" || is_test_file(&relative) {
            continue;
        }
        let parsed = syn::parse_file(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        let mut found = Imports {
            module: &module,
            found: BTreeSet::new(),
        };
        found.visit_file(&parsed);
        imports.extend(found.found.into_iter().map(|to| Import {
            from: module.clone(),
            to,
            file: relative.clone(),
        }));
    }
    Ok((undocumented, imports))
}

/// Each import that does not go down a layer, said with where it is; and the modules the layers
/// leave out.
fn violations(layers: &[Vec<String>], imports: &[Import]) -> Vec<String> {
    let rank: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, layer)| layer.iter().map(move |m| (m.as_str(), i)))
        .collect();
    let mut problems = BTreeSet::new();
    for import in imports {
        match (rank.get(import.from.as_str()), rank.get(import.to.as_str())) {
            (Some(from), Some(to)) if to > from => {}
            (Some(_), Some(_)) => {
                problems.insert(format!(
                    "{}: `{}` imports `{}`, which is not below it",
                    import.file.display(),
                    import.from,
                    import.to
                ));
            }
            (None, _) => {
                problems.insert(format!("module `{}` is in no layer", import.from));
            }
            (_, None) => {
                problems.insert(format!("module `{}` is in no layer", import.to));
            }
        }
    }
    problems.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask sits in the workspace")
            .to_path_buf()
    }

    #[test]
    fn every_module_imports_only_from_the_layers_below_it() {
        let root = root();
        let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
        let layers = layers(&readme).unwrap();
        let (_, imports) = scan(&root.join("redirect-userspace/src")).unwrap();
        assert!(imports.len() > 50, "only {} imports found", imports.len());
        let problems = violations(&layers, &imports);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn every_source_file_has_a_module_doc() {
        let (undocumented, _) = scan(&root().join("redirect-userspace/src")).unwrap();
        assert!(
            undocumented.is_empty(),
            "files without a //! doc: {undocumented:?}"
        );
    }

    #[test]
    fn an_import_upward_or_across_a_layer_is_named_with_its_file() {
        let layers = layers("**Layers**, top to bottom: `a` › `b`, `c` › `d`.").unwrap();
        assert_eq!(layers, [vec!["a"], vec!["b", "c"], vec!["d"]]);
        let import = |from: &str, to: &str| Import {
            from: from.into(),
            to: to.into(),
            file: PathBuf::from(format!("{from}/x.rs")),
        };
        let imports = [
            import("a", "d"),
            import("b", "d"),
            import("d", "a"),
            import("b", "c"),
            import("e", "a"),
        ];
        assert_eq!(
            violations(&layers, &imports),
            [
                "b/x.rs: `b` imports `c`, which is not below it",
                "d/x.rs: `d` imports `a`, which is not below it",
                "module `e` is in no layer",
            ]
        );
    }

    #[test]
    fn paths_in_test_items_comments_and_strings_do_not_count() {
        let source = r#"
            //! doc
            use crate::{alpha::A, beta::{self, B}};
            fn f() { let _ = crate::gamma::g(); let _ = "crate::delta"; }
            // crate::epsilon
            #[cfg(test)]
            mod tests { use crate::zeta; }
            #[cfg(test)]
            fn helper() { crate::eta::h(); }
        "#;
        let parsed = syn::parse_file(source).unwrap();
        let mut found = Imports {
            module: "alpha",
            found: BTreeSet::new(),
        };
        found.visit_file(&parsed);
        assert_eq!(
            found.found.into_iter().collect::<Vec<_>>(),
            ["beta", "gamma"]
        );
    }
}
