//! The layers of docs/architecture.md, held: each module of `src` imports only the layers
//! below it. A `use crate::...` (or any `crate::` path in code, comments aside) that
//! reaches up or sideways fails here, naming the file and the line.

use std::path::Path;

/// Each module, and the modules it must not name.
const FORBIDDEN: &[(&str, &[&str])] = &[
    // Generic scheduling: queues, routing, batching, health. Nothing about models.
    (
        "sched",
        &[
            "cuda", "tensorrt", "pipeline", "replica", "http", "codec", "config", "engines",
            "backend", "cli",
        ],
    ),
    // The CPU stages: pure functions of their inputs.
    (
        "pipeline",
        &[
            "replica", "http", "sched", "cuda", "tensorrt", "engines", "cli", "codec", "bench",
        ],
    ),
    (
        "codec",
        &[
            "replica", "http", "sched", "cuda", "tensorrt", "engines", "cli", "backend", "bench",
        ],
    ),
    // Bindings: nothing of celer's.
    (
        "tensorrt",
        &[
            "config", "pipeline", "engines", "replica", "http", "sched", "codec", "cuda",
            "backend", "cli", "bench",
        ],
    ),
    (
        "backend",
        &[
            "replica", "http", "sched", "cuda", "tensorrt", "engines", "cli", "codec", "bench",
        ],
    ),
    (
        "cuda",
        &[
            "replica", "http", "sched", "engines", "codec", "cli", "bench",
        ],
    ),
    (
        "engines",
        &[
            "replica", "http", "sched", "codec", "cli", "pipeline", "bench",
        ],
    ),
    ("replica", &["http", "cli", "bench"]),
    (
        "http",
        &["cli", "bench", "cuda", "tensorrt", "engines", "backend"],
    ),
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn each_layer_imports_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut broken = Vec::new();
    for (module, forbidden) in FORBIDDEN {
        let mut files = Vec::new();
        rust_files(&src.join(module), &mut files);
        assert!(!files.is_empty(), "src/{module} has no Rust files");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a source file");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for name in *forbidden {
                    if code.contains(&format!("crate::{name}::"))
                        || code.contains(&format!("crate::{name};"))
                        || code.contains(&format!("crate::{name}}}"))
                        || code.contains(&format!("crate::{{{name}"))
                    {
                        broken.push(format!(
                            "{}:{}: `{module}` names `{name}`: {}",
                            file.strip_prefix(&src).unwrap_or(&file).display(),
                            n + 1,
                            line.trim()
                        ));
                    }
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "layer rules broken:\n{}",
        broken.join("\n")
    );
}
