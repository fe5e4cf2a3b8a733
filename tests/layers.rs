//! The layers of docs/architecture.md, held. Each module of `src` names only the modules
//! the allow-list below gives it (any `crate::` path in code, `use` groups over several
//! lines included; comments and strings aside); the same table is in the document, and the
//! two must agree; the table has no circle; and inside each module, no two files import
//! each other (directly or round a longer circle), re-exports of the parent followed.
//! A new arrow fails here, naming the file and the line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each module of `src`, and the modules it may import. Lower layers first; every arrow
/// points down the list.
const ALLOWED: &[(&str, &[&str])] = &[
    // The ground floor: nothing of celer's.
    ("host", &[]),
    ("pixels", &[]),
    ("matte", &["pixels"]),
    ("oip", &[]),
    ("spec", &[]),
    ("stats", &[]),
    ("tensor", &[]),
    ("trace", &[]),
    // Bindings and backends.
    ("tensorrt", &[]),
    ("ort", &["host", "tensor"]),
    // The CPU stages, the codec, the GPU and its engines.
    ("stages", &["spec", "tensor"]),
    ("codec", &["matte", "pixels", "spec"]),
    // The kernels mirror the CPU stages' tables (taps, trimap values): `stages` is their
    // reference, the one arrow from the GPU to the CPU side.
    ("cuda", &["host", "pixels", "spec", "stages", "tensorrt"]),
    ("engines", &["cuda", "host", "spec", "tensorrt"]),
    // Scheduling is generic: no pixels, models or devices' internals.
    ("sched", &["spec", "stats"]),
    ("config", &["codec", "host", "sched", "trace"]),
    (
        "replica",
        &[
            "codec", "cuda", "engines", "matte", "ort", "pixels", "sched", "spec", "stages",
            "tensor", "tensorrt",
        ],
    ),
    // Reduced-precision variants, made offline: the gate runs the CPU pipeline.
    (
        "quantize",
        &[
            "codec", "engines", "host", "matte", "ort", "replica", "spec",
        ],
    ),
    (
        "http",
        &[
            "codec", "config", "host", "matte", "oip", "pixels", "replica", "sched", "spec",
            "trace",
        ],
    ),
    (
        "bench",
        &[
            "codec", "matte", "oip", "ort", "pixels", "replica", "spec", "stats",
        ],
    ),
    (
        "cli",
        &[
            "bench", "codec", "config", "cuda", "engines", "host", "http", "matte", "ort",
            "pixels", "quantize", "replica", "sched", "spec", "stats", "tensorrt", "trace",
        ],
    ),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The text with comments, strings and character literals blanked, line breaks kept (so
/// that line numbers still count).
fn code_only(text: &str) -> String {
    let bytes: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < bytes.len() {
        let c = bytes[i];
        let next = bytes.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < bytes.len() && bytes[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < bytes.len() {
                if bytes[i] == '/' && bytes.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if bytes[i] == '*' && bytes.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(bytes[i]));
                    i += 1;
                }
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < bytes.len() && bytes[i] != '"' {
                if bytes[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < bytes.len() {
                    out.push(blank(bytes[i]));
                    i += 1;
                }
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' && (bytes.get(i + 2) == Some(&'\'') || next == Some('\\')) {
            // A character literal ('"', '\n', '\''); a lifetime has no closing quote.
            out.push(' ');
            i += 1;
            while i < bytes.len() && bytes[i] != '\'' {
                if bytes[i] == '\\' {
                    i += 1;
                }
                i += 1;
                out.push(' ');
            }
            i += 1;
            out.push(' ');
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The first segment of each path that follows `prefix` (`crate::` or `super::`), with the
/// line it is on: `crate::a::b` gives `a`; `crate::{a::b, c}` gives `a` and `c`.
fn heads(code: &str, prefix: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut from = 0;
    while let Some(at) = code[from..].find(prefix) {
        let start = from + at;
        from = start + prefix.len();
        // `super::` inside `super::super::` is found again from the second one.
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[from..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item = String::new();
            let mut offset = 0;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 || (depth == 1 && c == ',') {
                    let name = ident(&item);
                    if !name.is_empty() {
                        found.push((name, line_of(from + 1 + offset)));
                    }
                    item.clear();
                    offset = k + 1;
                    if depth == 0 {
                        break;
                    }
                } else {
                    item.push(c);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                found.push((name, line_of(start)));
            }
        }
    }
    found
}

/// The modules of the allow-list other than `module` that `text`, a file of `module`,
/// names, each with its line.
fn named_modules(module: &str, text: &str) -> Vec<(String, usize)> {
    heads(&code_only(text), "crate::")
        .into_iter()
        .filter(|(name, _)| name != module && ALLOWED.iter().any(|(m, _)| m == name))
        .collect()
}

/// The arrows that break the allow-list in `text`, a file of module `module`.
fn forbidden_arrows(module: &str, text: &str) -> Vec<(String, usize)> {
    let allowed: &[&str] = ALLOWED
        .iter()
        .find(|(m, _)| *m == module)
        .map_or(&[], |(_, a)| *a);
    named_modules(module, text)
        .into_iter()
        .filter(|(name, _)| !allowed.contains(&name.as_str()))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file of `src` belongs to (`lib` and `main` for the roots).
fn module_of(file: &Path) -> String {
    let relative = file.strip_prefix(src()).expect("a file of src");
    let first = relative.components().next().expect("a path");
    first
        .as_os_str()
        .to_string_lossy()
        .trim_end_matches(".rs")
        .to_string()
}

/// Every file of `src` but the crate roots: its path, its module and its text.
fn sources() -> Vec<(PathBuf, String, String)> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files
        .into_iter()
        .map(|file| {
            let module = module_of(&file);
            let text = std::fs::read_to_string(&file).expect("a source file");
            (file, module, text)
        })
        .filter(|(_, module, _)| module != "lib" && module != "main")
        .collect()
}

#[test]
fn each_module_imports_only_what_the_allow_list_gives_it() {
    let mut broken = Vec::new();
    for (file, module, text) in sources() {
        assert!(
            ALLOWED.iter().any(|(m, _)| *m == module),
            "src/{module} is not in the allow-list of tests/layers.rs (nor docs/architecture.md)"
        );
        for (name, line) in forbidden_arrows(&module, &text) {
            broken.push(format!(
                "src/{}:{line}: `{module}` may not import `{name}`",
                file.strip_prefix(src()).unwrap_or(&file).display()
            ));
        }
    }
    assert!(broken.is_empty(), "layers broken:\n{}", broken.join("\n"));
}

/// The arrows the code has: for each module, the modules its files name.
fn arrows_in_code() -> BTreeMap<String, BTreeSet<String>> {
    let mut arrows: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (_, module, text) in sources() {
        let named = named_modules(&module, &text)
            .into_iter()
            .map(|(name, _)| name);
        arrows.entry(module).or_default().extend(named);
    }
    arrows
}

/// The table is the drawing of the code, not a licence: an arrow the code no longer has
/// leaves the table (and the document) too.
#[test]
fn the_allow_list_names_only_arrows_the_code_has() {
    let code = arrows_in_code();
    let unused: Vec<String> = ALLOWED
        .iter()
        .flat_map(|(module, allowed)| {
            let used = code.get(*module).cloned().unwrap_or_default();
            allowed
                .iter()
                .filter(move |t| !used.contains(**t))
                .map(move |t| format!("`{module}` -> `{t}`"))
        })
        .collect();
    assert!(
        unused.is_empty(),
        "arrows in the table that the code does not have:\n{}",
        unused.join("\n")
    );
}

#[test]
fn every_module_of_src_is_in_the_allow_list_and_no_other() {
    let listed: BTreeSet<String> = ALLOWED.iter().map(|(m, _)| m.to_string()).collect();
    let present: BTreeSet<String> = std::fs::read_dir(src())
        .unwrap()
        .flatten()
        .map(|e| {
            e.file_name()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .filter(|m| m != "lib" && m != "main")
        .collect();
    assert_eq!(listed, present);
}

/// A planted import of every module a layer may not name, in each of the forms a path can
/// take, is caught; one it may name is not.
#[test]
fn a_planted_forbidden_import_fails_in_every_layer() {
    let modules: Vec<&str> = ALLOWED.iter().map(|(m, _)| *m).collect();
    for (module, allowed) in ALLOWED {
        for target in modules
            .iter()
            .filter(|t| *t != module && !allowed.contains(t))
        {
            for planted in [
                format!("use crate::{target}::Anything;"),
                format!("use crate::{{\n    {target}::Anything,\n}};"),
                format!("fn f() {{ crate::{target}::call(); }}"),
            ] {
                let found = forbidden_arrows(module, &planted);
                assert_eq!(
                    found.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                    vec![*target],
                    "`{module}` planted with `{planted}`"
                );
            }
        }
        for target in *allowed {
            let planted = format!("use crate::{{{target}::A, {target}::B}};");
            assert!(forbidden_arrows(module, &planted).is_empty(), "{planted}");
        }
        // Comments and strings are not imports.
        let quiet = "// use crate::cli::X;\nlet s = \"crate::cli::\"; /* crate::cli */";
        assert!(forbidden_arrows(module, quiet).is_empty() || *module == "cli");
    }
}

#[test]
fn the_allow_list_has_no_circle_and_points_down() {
    let order: Vec<&str> = ALLOWED.iter().map(|(m, _)| *m).collect();
    for (position, (module, allowed)) in ALLOWED.iter().enumerate() {
        for target in *allowed {
            let at = order
                .iter()
                .position(|m| m == target)
                .unwrap_or_else(|| panic!("`{module}` allows `{target}`, which is not a module"));
            assert!(
                at < position,
                "`{module}` may import `{target}`, listed after it: an arrow up"
            );
        }
    }
}

/// The table of docs/architecture.md between its `layers` markers: each row's module and
/// the modules it may import (backticked names in the last column; `-` for none).
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .expect("docs/architecture.md");
    let start = doc
        .find("<!-- layers:begin -->")
        .expect("docs/architecture.md has a `<!-- layers:begin -->` marker");
    let end = doc
        .find("<!-- layers:end -->")
        .expect("docs/architecture.md has a `<!-- layers:end -->` marker");
    let names = |cell: &str| -> BTreeSet<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    doc[start..end]
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|-") && !l.starts_with("| module"))
        .map(|row| {
            let cells: Vec<&str> = row.trim_matches('|').split('|').collect();
            let module = names(cells[0])
                .into_iter()
                .next()
                .expect("a module in `backticks`");
            (module, names(cells[cells.len() - 1]))
        })
        .collect()
}

#[test]
fn the_document_draws_the_same_table() {
    let code: BTreeMap<String, BTreeSet<String>> = ALLOWED
        .iter()
        .map(|(m, a)| (m.to_string(), a.iter().map(|s| s.to_string()).collect()))
        .collect();
    let doc = documented();
    for (module, allowed) in &code {
        assert_eq!(
            doc.get(module),
            Some(allowed),
            "docs/architecture.md's row for `{module}` differs from tests/layers.rs"
        );
    }
    assert_eq!(
        doc.keys().collect::<Vec<_>>(),
        code.keys().collect::<Vec<_>>(),
        "docs/architecture.md lists other modules than tests/layers.rs"
    );
}

/// Inside each folder of `src`, the files that import one another: an arrow from a file to
/// a sibling it names (`super::sibling`, `crate::module::sibling`, or an item the folder's
/// `mod.rs` re-exports from that sibling).
fn sibling_arrows(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let stem = |p: &Path| p.file_stem().unwrap().to_string_lossy().to_string();
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    let children: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| stem(&e.path()))
        .filter(|s| s != "mod")
        .collect();
    // What mod.rs re-exports, and from which child.
    let mut exported: BTreeMap<String, String> = BTreeMap::new();
    if let Ok(parent) = std::fs::read_to_string(dir.join("mod.rs")) {
        let code = code_only(&parent);
        for statement in code.split(';') {
            let Some(at) = statement.find("pub use ") else {
                continue;
            };
            let path = statement[at + 8..].trim();
            let child: String = path
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !children.contains(&child) {
                continue;
            }
            let items = path[child.len()..].trim_start_matches("::");
            for item in items.trim_matches(|c| c == '{' || c == '}').split(',') {
                let name = item.rsplit("::").next().unwrap_or("").trim();
                let name = name.rsplit(" as ").next().unwrap_or(name).trim();
                if !name.is_empty() {
                    exported.insert(name.to_string(), child.clone());
                }
            }
        }
    }
    let relative = dir.strip_prefix(src()).unwrap();
    let crate_prefix = format!("crate::{}::", relative.to_string_lossy().replace('/', "::"));
    let mut arrows: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files.iter().filter(|f| stem(f) != "mod") {
        let me = stem(file);
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        // Only the file's own code: its test module may use anything.
        let code = code.split("#[cfg(test)]").next().unwrap_or("");
        let mut named: Vec<String> = heads(code, "super::").into_iter().map(|(n, _)| n).collect();
        named.extend(heads(code, &crate_prefix).into_iter().map(|(n, _)| n));
        for name in named {
            let target = if children.contains(&name) {
                Some(name)
            } else {
                exported.get(&name).cloned()
            };
            if let Some(target) = target.filter(|t| *t != me) {
                arrows.entry(me.clone()).or_default().insert(target);
            }
        }
    }
    arrows
}

/// A circle in `arrows`, if there is one, as the files round it.
fn circle(arrows: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        arrows: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut round = path[at..].to_vec();
            round.push(node.to_string());
            return Some(round);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in arrows.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, arrows, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    arrows
        .keys()
        .find_map(|start| visit(start, arrows, &mut Vec::new(), &mut done))
}

#[test]
fn no_two_files_of_a_module_import_each_other() {
    let mut dirs = vec![];
    fn folders(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            if entry.path().is_dir() {
                out.push(entry.path());
                folders(&entry.path(), out);
            }
        }
    }
    folders(&src(), &mut dirs);
    let circles: Vec<String> = dirs
        .iter()
        .filter_map(|dir| {
            circle(&sibling_arrows(dir)).map(|round| {
                format!(
                    "src/{}: {}",
                    dir.strip_prefix(src()).unwrap().display(),
                    round.join(" -> ")
                )
            })
        })
        .collect();
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn a_planted_circle_is_found() {
    let arrows: BTreeMap<String, BTreeSet<String>> = [
        ("batcher", &["job"][..]),
        ("worker", &["batcher", "job"]),
        ("job", &["worker"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
    .collect();
    let round = circle(&arrows).expect("the circle job -> worker -> job");
    assert_eq!(round.first(), round.last());
    assert!(round.contains(&"worker".to_string()) && round.contains(&"job".to_string()));
}
