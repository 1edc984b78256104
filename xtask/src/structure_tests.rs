//! The structure rules on small fake workspaces written to a temporary directory.

use super::{check, run, Circle, Report, Tree, PLANNER_CRATE};
use std::fs;
use std::path::{Path, PathBuf};

/// A fake workspace under the temporary directory, removed when dropped.
struct Fake {
    root: PathBuf,
}

impl Fake {
    fn new(name: &str) -> Fake {
        let root = std::env::temp_dir().join(format!(
            "xtask-structure-{name}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        Fake { root }
    }

    /// Writes `text` at `path` (relative to the root), directories included.
    fn file(&self, path: &str, text: &str) -> &Fake {
        let path = self.root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
        self
    }

    fn report(&self) -> Report {
        check(&self.root).unwrap()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// A circle as `(files, ["from -> to: items", ..])`.
fn shown(circle: &Circle) -> (Vec<&str>, Vec<String>) {
    let files = circle.files.iter().map(String::as_str).collect();
    let edges = circle.edges.iter();
    let edges = edges.map(|e| format!("{} -> {}: {}", e.from, e.to, e.items.join(", ")));
    (files, edges.collect())
}

/// A function of `lines` lines, signature to closing brace.
fn function(name: &str, lines: usize) -> String {
    let body = "    let _ = 1;\n".repeat(lines - 2);
    format!("fn {name}() {{\n{body}}}\n")
}

#[test]
fn structure_finds_a_circle_of_use_lines() {
    let fake = Fake::new("use-lines");
    fake.file("crates/demo/src/lib.rs", "mod a;\nmod b;\n")
        .file(
            "crates/demo/src/a.rs",
            "use crate::b::X;\npub struct Y;\npub fn f(_: X) {}\n",
        )
        .file(
            "crates/demo/src/b.rs",
            "use crate::a::{self, Y};\npub struct X;\npub fn g(_: Y) { a::f(X) }\n",
        );
    let report = fake.report();
    assert_eq!(report.circles.len(), 1);
    let (files, edges) = shown(&report.circles[0]);
    assert_eq!(files, ["a.rs", "b.rs"]);
    assert_eq!(edges, ["a.rs -> b.rs: X", "b.rs -> a.rs: Y, f"]);
    assert!(report.circles[0].target.starts_with("crates/demo (lib"));
    let error = run(&fake.root).unwrap_err().to_string();
    assert!(error.contains("structure rules broken: 1 module import circle"));
}

#[test]
fn structure_finds_a_circle_through_super_paths_in_code() {
    let fake = Fake::new("super-path");
    fake.file("crates/demo/src/lib.rs", "pub mod p;\n")
        .file(
            "crates/demo/src/p/mod.rs",
            "mod q;\npub struct Top;\npub fn make() -> usize { q::inner(); 1 }\n",
        )
        .file(
            "crates/demo/src/p/q.rs",
            "pub fn inner() { let _top = super::Top; }\n",
        );
    let report = fake.report();
    assert_eq!(report.circles.len(), 1);
    let (files, edges) = shown(&report.circles[0]);
    assert_eq!(files, ["p/mod.rs", "p/q.rs"]);
    assert_eq!(
        edges,
        ["p/mod.rs -> p/q.rs: inner", "p/q.rs -> p/mod.rs: Top"]
    );
}

#[test]
fn structure_follows_re_export_chains_to_the_defining_module() {
    let fake = Fake::new("re-export");
    fake.file(
        "crates/demo/src/lib.rs",
        "mod a;\nmod c;\nmod hub;\npub use hub::Z;\n",
    )
    .file("crates/demo/src/hub.rs", "pub use crate::c::*;\n")
    .file(
        "crates/demo/src/a.rs",
        "use crate::Z;\npub struct A;\npub fn f(_: Z) {}\n",
    )
    .file(
        "crates/demo/src/c.rs",
        "pub struct Z;\npub fn g(_: crate::a::A) {}\n",
    );
    let report = fake.report();
    assert_eq!(report.circles.len(), 1);
    let (files, edges) = shown(&report.circles[0]);
    assert_eq!(files, ["a.rs", "c.rs"]);
    assert_eq!(edges, ["a.rs -> c.rs: Z", "c.rs -> a.rs: A"]);
}

#[test]
fn structure_sees_no_circle_in_a_parent_that_only_re_exports() {
    let fake = Fake::new("re-exporting-parent");
    fake.file("crates/demo/src/lib.rs", "pub mod p;\n")
        .file(
            "crates/demo/src/p/mod.rs",
            "mod x;\nmod y;\npub use x::A;\npub use y::B;\n",
        )
        .file(
            "crates/demo/src/p/x.rs",
            "use super::B;\npub struct A;\npub fn f(_: B) -> super::B { super::B }\n",
        )
        .file("crates/demo/src/p/y.rs", "pub struct B;\n");
    let report = fake.report();
    assert!(report.circles.is_empty(), "{:?}", report.describe());
    assert_eq!(report.modules, 4);
    run(&fake.root).unwrap();
    // The parent's re-exports are followed, not dependencies of its own.
    let (krate, main) = (
        Path::new("crates/demo"),
        Path::new("crates/demo/src/lib.rs"),
    );
    let tree = Tree::load(&fake.root, krate, "lib", main).unwrap();
    let edges: Vec<String> = tree
        .edges()
        .iter()
        .map(|(&(from, to), items)| {
            format!("{} -> {}: {items:?}", tree.shown(from), tree.shown(to))
        })
        .collect();
    assert_eq!(edges, [r#"p/x.rs -> p/y.rs: {"B"}"#]);
}

#[test]
fn structure_leaves_test_modules_out_of_circles() {
    let fake = Fake::new("cfg-test");
    fake.file("crates/demo/src/lib.rs", "mod a;\n")
        .file(
            "crates/demo/src/a.rs",
            "pub struct S;\n\
             #[cfg(test)]\nfn probe() -> tests::T { tests::T }\n\
             #[cfg(test)]\nfn probe_more() -> more::M { more::M }\n\
             #[cfg(test)]\nmod tests {\n    use super::S;\n    pub struct T;\n    fn f(_: S) {}\n}\n\
             #[cfg(all(test, feature = \"x\"))]\nmod more;\n",
        )
        .file(
            "crates/demo/src/a/more.rs",
            "use super::S;\npub struct M;\nfn g(_: S) {}\n",
        );
    let report = fake.report();
    assert!(report.circles.is_empty(), "{:?}", report.describe());
    assert_eq!(report.modules, 2);
    assert_eq!(report.fns.len(), 0);
}

#[test]
fn structure_reports_functions_over_100_lines() {
    let fake = Fake::new("long-fns");
    let lib = format!(
        "{}/// Documented.\n#[inline]\n{}pub struct S;\nimpl S {{\n    pub {}}}\npub(crate)\n{}",
        function("long", 101),
        function("just_fits", 100),
        function("method", 101),
        // 100 lines from `fn`, 101 from its first token.
        function("split_signature", 100),
    );
    fake.file("crates/demo/src/lib.rs", &lib)
        .file("xtask/src/main.rs", &function("main", 150))
        .file("tests/src/lib.rs", &function("helper", 150));
    let report = fake.report();
    let long: Vec<String> = report
        .long_fns()
        .iter()
        .map(|f| {
            format!(
                "{}:{} {} ({} lines)",
                f.file.display(),
                f.line,
                f.name,
                f.lines
            )
        })
        .collect();
    assert_eq!(
        long,
        [
            "crates/demo/src/lib.rs:1 long (101 lines)",
            "crates/demo/src/lib.rs:206 S::method (101 lines)",
            "crates/demo/src/lib.rs:308 split_signature (101 lines)",
        ]
    );
    let fits = report.fns.iter().find(|f| f.name == "just_fits").unwrap();
    assert_eq!((fits.line, fits.lines), (104, 100));
    let error = run(&fake.root).unwrap_err().to_string();
    assert!(error.contains("3 function(s) over 100 lines"), "{error}");
}

#[test]
fn structure_leaves_test_functions_out_of_the_length_rule() {
    let fake = Fake::new("test-fns");
    let lib = format!(
        "mod a;\n#[test]\n{}#[cfg(test)]\nmod tests {{\n{}}}\n#[cfg(test)]\nmod more;\n\
         struct S;\nimpl S {{\n    #[cfg(test)]\n    {}}}\n",
        function("a_test", 101),
        function("helper", 101),
        function("test_method", 101),
    );
    fake.file("crates/demo/src/lib.rs", &lib)
        .file("crates/demo/src/a.rs", &function("fits", 100))
        .file("crates/demo/src/more.rs", &function("long_helper", 150));
    let report = fake.report();
    let names: Vec<&str> = report.fns.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["fits"]);
    assert!(report.violations().is_empty());
}

#[test]
fn structure_reports_planner_files_over_700_lines() {
    let fake = Fake::new("planner-files");
    assert!(fake.report().planner_files.is_none());
    let src = Path::new(PLANNER_CRATE).join("src");
    let lines = |n: usize| "// a line\n".repeat(n);
    fake.file(src.join("lib.rs").to_str().unwrap(), &lines(700))
        .file(src.join("deep/big.rs").to_str().unwrap(), &lines(701));
    let report = fake.report();
    let big: Vec<String> = report
        .big_files()
        .iter()
        .map(|(file, n)| format!("{} ({n} lines)", file.display()))
        .collect();
    assert_eq!(
        big,
        ["crates/synerfuse-planner/src/deep/big.rs (701 lines)"]
    );
    assert_eq!(report.planner_files.as_ref().unwrap().len(), 2);
    let error = run(&fake.root).unwrap_err().to_string();
    assert!(
        error.contains("1 planner file(s) over 700 lines"),
        "{error}"
    );
}
