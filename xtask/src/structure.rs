//! `cargo xtask structure`: the house rules the compiler cannot see, checked on the
//! source text (parsed with `syn`) so that CI fails when one breaks.
//!
//! 1. No module import circle inside a crate. A module (a file, or an inline `mod x { }`)
//!    depends on another when its code names an item defined there. `use` re-exports are
//!    followed to the module that defines the item and are never dependencies themselves;
//!    declaring `mod child;` is none either. Two modules or more that reach each other are
//!    a circle.
//! 2. No function of the crates' code (`crates/*/src`, tests aside) over [`MAX_FN_LINES`]
//!    lines, from its signature to its closing brace.
//! 3. No file of the planner crate ([`PLANNER_CRATE`]) over [`MAX_PLANNER_FILE_LINES`] lines.
//!
//! Test code (`#[cfg(test)]` modules, their files and items, `#[test]` functions) is left
//! out of rules 1 and 2. Names are resolved without types: method calls (`x.f()`) and
//! what a macro expands to are not seen, and what does not resolve is ignored.

use anyhow::{bail, Context, Result};
use proc_macro2::{TokenStream, TokenTree};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Attribute, Block, ForeignItem, Item, Meta, Signature, Token, UseTree, Visibility};

/// The crate whose files rule 3 bounds, relative to the workspace root.
const PLANNER_CRATE: &str = "crates/synerfuse-planner";
/// Rule 2: the most lines a function may span, signature to closing brace.
const MAX_FN_LINES: usize = 100;
/// Rule 3: the most lines a planner-crate file may have.
const MAX_PLANNER_FILE_LINES: usize = 700;
/// How many `use` hops a resolution follows (re-export chains, globs) before giving up.
const MAX_HOPS: usize = 32;

/// Checks the three rules on the workspace at `root`: one summary line when they hold,
/// else every violation, grouped by rule, and an error.
pub fn run(root: &Path) -> Result<()> {
    let report = check(root)?;
    let broken = report.violations();
    if broken.is_empty() {
        if report.planner_files.is_none() {
            println!(
                "== structure: note: no {PLANNER_CRATE}, so rule 3 had no planner crate to check"
            );
        }
        println!("{}", report.summary());
        return Ok(());
    }
    for line in report.describe() {
        println!("{line}");
    }
    bail!("structure rules broken: {}", broken.join(", "))
}

/// What the rules measured on a workspace.
#[derive(Default)]
struct Report {
    crates: usize,
    modules: usize,
    circles: Vec<Circle>,
    /// Every function of the crates' code (rule 2), by file and line.
    fns: Vec<FnSpan>,
    /// The planner crate's files and their line counts; `None` without the crate.
    planner_files: Option<Vec<(PathBuf, usize)>>,
}

/// A circle of modules in one target: its files (relative to the crate's `src/`, an inline
/// module as `file.rs::name`) and the dependencies between them.
struct Circle {
    target: String,
    src: PathBuf,
    files: Vec<String>,
    edges: Vec<Edge>,
}

/// `from` names `items`, defined in `to`.
struct Edge {
    from: String,
    to: String,
    items: Vec<String>,
}

/// A function with a body: where it starts, its name (`Type::name` for a method), its lines.
#[derive(Clone)]
struct FnSpan {
    file: PathBuf,
    line: usize,
    name: String,
    lines: usize,
}

/// Reads every crate's module trees and measures what the rules bound.
fn check(root: &Path) -> Result<Report> {
    let crates = crate_dirs(root)?;
    let mut report = Report {
        crates: crates.len(),
        ..Report::default()
    };
    // By file and line: a file in two targets' trees counts once.
    let mut fns = BTreeMap::new();
    for krate in &crates {
        for (kind, main) in target_roots(root, krate)? {
            let tree = Tree::load(root, krate, kind, &main)?;
            report.modules += tree.modules.len();
            report.circles.extend(tree.circles());
            if krate.starts_with("crates") {
                for f in tree.fns {
                    fns.insert((f.file.clone(), f.line), f);
                }
            }
        }
    }
    report.fns = fns.into_values().collect();
    report.planner_files = planner_files(root)?;
    Ok(report)
}

impl Report {
    fn long_fns(&self) -> Vec<&FnSpan> {
        self.fns.iter().filter(|f| f.lines > MAX_FN_LINES).collect()
    }

    fn big_files(&self) -> Vec<&(PathBuf, usize)> {
        let files = self.planner_files.iter().flatten();
        files.filter(|(_, n)| *n > MAX_PLANNER_FILE_LINES).collect()
    }

    /// One phrase per broken rule, for the error; empty when all hold.
    fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        let counts = [
            (self.circles.len(), "module import circle(s)".to_string()),
            (
                self.long_fns().len(),
                format!("function(s) over {MAX_FN_LINES} lines"),
            ),
            (
                self.big_files().len(),
                format!("planner file(s) over {MAX_PLANNER_FILE_LINES} lines"),
            ),
        ];
        for (n, what) in counts {
            if n > 0 {
                broken.push(format!("{n} {what}"));
            }
        }
        broken
    }

    /// The line printed when every rule holds.
    fn summary(&self) -> String {
        let longest = match self.fns.iter().max_by_key(|f| f.lines) {
            Some(f) => format!(
                "longest library function {} lines at {}:{}",
                f.lines,
                f.file.display(),
                f.line
            ),
            None => "no library function".to_string(),
        };
        let largest = match &self.planner_files {
            None => "no planner crate".to_string(),
            Some(files) => match files.iter().max_by_key(|(_, n)| *n) {
                Some((file, n)) => format!("largest planner file {n} lines ({})", file.display()),
                None => "no planner file".to_string(),
            },
        };
        format!(
            "== structure: ok ({} crates, {} modules, no circle; {longest}; {largest})",
            self.crates, self.modules
        )
    }

    /// Every violation, grouped by rule.
    fn describe(&self) -> Vec<String> {
        let mut out = vec![format!(
            "== structure: rule 1, no module import circle inside a crate: {} circle(s)",
            self.circles.len()
        )];
        for (i, circle) in self.circles.iter().enumerate() {
            out.push(format!(
                "circle {}: {}, {} modules under {}:",
                i + 1,
                circle.target,
                circle.files.len(),
                circle.src.display()
            ));
            out.extend(circle.files.iter().map(|f| format!("    {f}")));
            for e in &circle.edges {
                out.push(format!(
                    "    {} -> {}: {}",
                    e.from,
                    e.to,
                    e.items.join(", ")
                ));
            }
        }
        let long = self.long_fns();
        out.push(format!(
            "== structure: rule 2, no library function over {MAX_FN_LINES} lines: {} function(s)",
            long.len()
        ));
        for f in long {
            let (file, line, name) = (f.file.display(), f.line, &f.name);
            out.push(format!("    {file}:{line} {name} ({} lines)", f.lines));
        }
        out.extend(self.describe_rule3());
        out
    }

    fn describe_rule3(&self) -> Vec<String> {
        let rule = format!(
            "== structure: rule 3, no {PLANNER_CRATE} file over {MAX_PLANNER_FILE_LINES} lines"
        );
        if self.planner_files.is_none() {
            return vec![format!("{rule}: no planner crate to check")];
        }
        let big = self.big_files();
        let mut out = vec![format!("{rule}: {} file(s)", big.len())];
        for (file, n) in big {
            out.push(format!("    {} ({n} lines)", file.display()));
        }
        out
    }
}

/// The crates rule 1 reads: each `crates/*` with a `src/`, then `tests/` and `xtask/`
/// (relative to the root).
fn crate_dirs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    if root.join("crates").is_dir() {
        for entry in fs::read_dir(root.join("crates")).context("could not list crates/")? {
            let krate = Path::new("crates").join(entry?.file_name());
            if root.join(&krate).join("src").is_dir() {
                dirs.push(krate);
            }
        }
    }
    dirs.sort();
    for extra in ["tests", "xtask"] {
        if root.join(extra).join("src").is_dir() {
            dirs.push(PathBuf::from(extra));
        }
    }
    Ok(dirs)
}

/// A crate's target roots, library first: the `[lib]` and `[[bin]]` paths of its
/// Cargo.toml and cargo's conventions (src/lib.rs, src/main.rs, src/bin/*.rs,
/// src/bin/*/main.rs). Each is a module tree of its own.
fn target_roots(root: &Path, krate: &Path) -> Result<Vec<(&'static str, PathBuf)>> {
    let manifest = fs::read_to_string(root.join(krate).join("Cargo.toml")).unwrap_or_default();
    let (lib_path, bin_paths) = manifest_paths(&manifest);
    let lib = krate.join(lib_path.as_deref().unwrap_or("src/lib.rs"));
    let mut bins: BTreeSet<PathBuf> = bin_paths.iter().map(|p| krate.join(p)).collect();
    bins.insert(krate.join("src/main.rs"));
    let bin_dir = krate.join("src/bin");
    if root.join(&bin_dir).is_dir() {
        for entry in fs::read_dir(root.join(&bin_dir))? {
            let name = entry?.file_name();
            let path = bin_dir.join(&name);
            if name.to_string_lossy().ends_with(".rs") {
                bins.insert(path);
            } else {
                bins.insert(path.join("main.rs"));
            }
        }
    }
    let mut roots = Vec::new();
    if root.join(&lib).is_file() {
        roots.push(("lib", lib.clone()));
    }
    let bins = bins
        .into_iter()
        .filter(|b| *b != lib && root.join(b).is_file());
    roots.extend(bins.map(|b| ("bin", b)));
    Ok(roots)
}

/// The `[lib] path` and every `[[bin]] path` of a manifest, read line by line (xtask has
/// no TOML parser, and these are one-line `path = "..."` entries).
fn manifest_paths(manifest: &str) -> (Option<String>, Vec<String>) {
    let (mut section, mut lib, mut bins) = ("", None, Vec::new());
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
            continue;
        }
        let value = line.strip_prefix("path").map(str::trim_start);
        let Some(value) = value.and_then(|v| v.strip_prefix('=')) else {
            continue;
        };
        let value = value.trim().trim_matches('"').to_string();
        match section {
            "[lib]" => lib = Some(value),
            "[[bin]]" => bins.push(value),
            _ => {}
        }
    }
    (lib, bins)
}

/// Rule 3's measure: every `.rs` file under the planner crate's `src/` with its lines
/// (newline-terminated, as `wc -l` counts them); `None` while the crate does not exist.
fn planner_files(root: &Path) -> Result<Option<Vec<(PathBuf, usize)>>> {
    if !root.join(PLANNER_CRATE).is_dir() {
        return Ok(None);
    }
    let mut files = Vec::new();
    rust_files(root, &Path::new(PLANNER_CRATE).join("src"), &mut files)?;
    let mut counted = Vec::new();
    for file in files {
        let text = fs::read(root.join(&file))
            .with_context(|| format!("could not read {}", file.display()))?;
        counted.push((file, text.iter().filter(|&&b| b == b'\n').count()));
    }
    Ok(Some(counted))
}

/// The `.rs` files under `dir` (relative to `root`), recursively, sorted.
fn rust_files(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if !root.join(dir).is_dir() {
        return Ok(());
    }
    let mut entries = Vec::new();
    for entry in fs::read_dir(root.join(dir))? {
        entries.push(dir.join(entry?.file_name()));
    }
    entries.sort();
    for path in entries {
        if root.join(&path).is_dir() {
            rust_files(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// One module of a tree: a file, or an inline module inside one.
#[derive(Default)]
struct Module {
    /// Relative to the workspace root.
    file: PathBuf,
    /// The inline modules, outermost first, from the file down to this one.
    inline: Vec<String>,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// The names defined here (functions, types, traits, consts, statics).
    items: BTreeSet<String>,
    /// Each enum's variants: what `use Enum::*` brings in.
    variants: BTreeMap<String, BTreeSet<String>>,
    /// `#[macro_export]` macros, which live at the crate root: name -> defining module.
    exported: BTreeMap<String, usize>,
    /// Module-level `use` bindings (private ones too: children see them through `super::`).
    uses: BTreeMap<String, Vec<String>>,
    globs: Vec<Vec<String>>,
    /// `use`s inside function bodies: seen by this module's own paths only.
    local_uses: BTreeMap<String, Vec<String>>,
    local_globs: Vec<Vec<String>>,
    /// The paths this module's code names: private `use` leaves and paths in code.
    refs: Vec<Vec<String>>,
}

/// What a path leads to: a module, or an item (by name) and the module defining it.
enum Found {
    Module(usize),
    Item(usize, String),
}

/// One target's module tree (a library or a binary), module 0 its root, with the spans
/// of its functions.
struct Tree {
    label: String,
    /// What circles' files are shown relative to: the crate's `src/`.
    src: PathBuf,
    modules: Vec<Module>,
    fns: Vec<FnSpan>,
}

impl Tree {
    /// Reads the tree rooted at `main`, a file of the crate at `krate`.
    fn load(root: &Path, krate: &Path, kind: &str, main: &Path) -> Result<Tree> {
        let shown = main.strip_prefix(krate).unwrap_or(main).display();
        let src = krate.join("src");
        let src = if main.starts_with(&src) {
            src
        } else {
            main.parent().map(Path::to_path_buf).unwrap_or_default()
        };
        let mut tree = Tree {
            label: format!("{} ({kind} {shown})", krate.display()),
            src,
            modules: Vec::new(),
            fns: Vec::new(),
        };
        tree.load_file(root, main.to_path_buf(), None, "", true)?;
        Ok(tree)
    }

    /// Parses `file` as the module `name` under `parent`, then its items and children.
    /// `mod_rs`: a crate root, mod.rs or `#[path]` file, whose children sit beside it.
    fn load_file(
        &mut self,
        root: &Path,
        file: PathBuf,
        parent: Option<usize>,
        name: &str,
        mod_rs: bool,
    ) -> Result<()> {
        let text = fs::read_to_string(root.join(&file))
            .with_context(|| format!("could not read {}", file.display()))?;
        let ast = syn::parse_file(&text)
            .with_context(|| format!("could not parse {}", file.display()))?;
        let dir = if mod_rs {
            file.parent().map(Path::to_path_buf).unwrap_or_default()
        } else {
            file.with_extension("")
        };
        let idx = self.add_module(file, Vec::new(), parent, name);
        self.add_items(root, idx, &ast.items, &dir)
    }

    fn add_module(
        &mut self,
        file: PathBuf,
        inline: Vec<String>,
        parent: Option<usize>,
        name: &str,
    ) -> usize {
        let idx = self.modules.len();
        self.modules.push(Module {
            file,
            inline,
            parent,
            ..Module::default()
        });
        if let Some(parent) = parent {
            self.modules[parent].children.insert(name.to_string(), idx);
        }
        idx
    }

    /// Adds a module's items: child modules, `use` bindings, definitions, and the paths and
    /// functions in its code. Test-only items are not there for the rules.
    fn add_items(&mut self, root: &Path, idx: usize, items: &[Item], dir: &Path) -> Result<()> {
        for item in items {
            if is_test_only(item_attrs(item)) {
                continue;
            }
            match item {
                Item::Mod(m) => self.add_mod(root, idx, m, dir)?,
                Item::Use(u) => self.add_use(idx, u),
                _ => {
                    self.define(idx, item);
                    self.collect_code(idx, item);
                }
            }
        }
        Ok(())
    }

    /// A child module: inline (`mod x { .. }`) or from its file (x.rs, x/mod.rs or the
    /// `#[path]`); one whose file is missing is left out.
    fn add_mod(&mut self, root: &Path, idx: usize, m: &syn::ItemMod, dir: &Path) -> Result<()> {
        let name = m.ident.to_string();
        if let Some((_, items)) = &m.content {
            let mut inline = self.modules[idx].inline.clone();
            inline.push(name.clone());
            let file = self.modules[idx].file.clone();
            let child = self.add_module(file, inline, Some(idx), &name);
            return self.add_items(root, child, items, &dir.join(&name));
        }
        let (file, mod_rs) = match path_attr(&m.attrs) {
            // Relative to the declaring file's directory, or below it inside inline modules.
            Some(path) if self.modules[idx].inline.is_empty() => {
                let file = &self.modules[idx].file;
                (file.parent().unwrap_or(Path::new("")).join(path), true)
            }
            Some(path) => (dir.join(path), true),
            None => {
                let flat = dir.join(format!("{name}.rs"));
                if root.join(&flat).is_file() {
                    (flat, false)
                } else {
                    (dir.join(&name).join("mod.rs"), true)
                }
            }
        };
        if !root.join(&file).is_file() {
            return Ok(());
        }
        self.load_file(root, file, Some(idx), &name, mod_rs)
    }

    /// A module-level `use`: its bindings, and (when private, so for this module's own
    /// code) a reference per imported name. `pub` ones are re-exports: only followed.
    fn add_use(&mut self, idx: usize, item: &syn::ItemUse) {
        let mut leaves = Vec::new();
        let prefix = if item.leading_colon.is_some() {
            vec!["::".to_string()]
        } else {
            Vec::new()
        };
        use_leaves(&item.tree, prefix, &mut leaves);
        let private = matches!(item.vis, Visibility::Inherited);
        let module = &mut self.modules[idx];
        for leaf in leaves {
            match leaf {
                UseLeaf::Glob(path) => module.globs.push(path),
                UseLeaf::Name(bind, path) => {
                    if private {
                        module.refs.push(path.clone());
                    }
                    if let Some(bind) = bind {
                        module.uses.insert(bind, path);
                    }
                }
            }
        }
    }

    /// Records the names an item defines in module `idx` (enum variants too, for globs).
    fn define(&mut self, idx: usize, item: &Item) {
        let name = match item {
            Item::Const(i) => &i.ident,
            Item::Fn(i) => &i.sig.ident,
            Item::Static(i) => &i.ident,
            Item::Struct(i) => &i.ident,
            Item::Trait(i) => &i.ident,
            Item::TraitAlias(i) => &i.ident,
            Item::Type(i) => &i.ident,
            Item::Union(i) => &i.ident,
            Item::Enum(i) => {
                let variants = i.variants.iter().map(|v| v.ident.to_string());
                let variants = variants.collect();
                self.modules[idx]
                    .variants
                    .insert(i.ident.to_string(), variants);
                &i.ident
            }
            Item::ForeignMod(f) => {
                for foreign in &f.items {
                    let name = match foreign {
                        ForeignItem::Fn(x) => &x.sig.ident,
                        ForeignItem::Static(x) => &x.ident,
                        ForeignItem::Type(x) => &x.ident,
                        _ => continue,
                    };
                    self.modules[idx].items.insert(name.to_string());
                }
                return;
            }
            Item::Macro(m) => {
                let exported = m.attrs.iter().any(|a| a.path().is_ident("macro_export"));
                if let (Some(name), true) = (&m.ident, exported) {
                    self.modules[0].exported.insert(name.to_string(), idx);
                }
                return;
            }
            _ => return,
        };
        self.modules[idx].items.insert(name.to_string());
    }

    /// Walks an item's code for the paths it names, its function bodies' `use`s and the
    /// spans of its functions.
    fn collect_code(&mut self, idx: usize, item: &Item) {
        let mut collector = Collector {
            file: self.modules[idx].file.clone(),
            owner: Vec::new(),
            refs: Vec::new(),
            uses: Vec::new(),
            fns: Vec::new(),
        };
        collector.visit_item(item);
        let module = &mut self.modules[idx];
        module.refs.extend(collector.refs);
        for leaf in collector.uses {
            match leaf {
                UseLeaf::Glob(path) => module.local_globs.push(path),
                UseLeaf::Name(bind, path) => {
                    module.refs.push(path.clone());
                    if let Some(bind) = bind {
                        module.local_uses.insert(bind, path);
                    }
                }
            }
        }
        self.fns.extend(collector.fns);
    }

    /// Resolves `path` as written in module `m` (`local`: with m's function-body `use`s).
    fn resolve(&self, m: usize, path: &[String], hops: usize, local: bool) -> Option<Found> {
        if hops > MAX_HOPS {
            return None;
        }
        let (first, rest) = path.split_first()?;
        let mut at = self.step(m, first, hops, local)?;
        for segment in rest {
            at = match at {
                Found::Module(cur) => self.step(cur, segment, hops, false)?,
                // A variant or an associated item: it belongs to the type's module.
                Found::Item(..) => break,
            };
        }
        Some(at)
    }

    /// One path segment inside module `m`.
    fn step(&self, m: usize, segment: &str, hops: usize, local: bool) -> Option<Found> {
        match segment {
            "crate" => Some(Found::Module(0)),
            "self" => Some(Found::Module(m)),
            "super" => self.modules[m].parent.map(Found::Module),
            name => self.lookup(m, name, hops, local),
        }
    }

    /// What `name` means in module `m`: a child module, an item defined there, or what a
    /// `use` there binds it to (followed to its definition), explicit names before globs.
    fn lookup(&self, m: usize, name: &str, hops: usize, local: bool) -> Option<Found> {
        let module = &self.modules[m];
        if let Some(&child) = module.children.get(name) {
            return Some(Found::Module(child));
        }
        if module.items.contains(name) {
            return Some(Found::Item(m, name.to_string()));
        }
        if let Some(&defined) = module.exported.get(name) {
            return Some(Found::Item(defined, name.to_string()));
        }
        let bound = module.uses.get(name);
        let bound = bound.or_else(|| local.then(|| module.local_uses.get(name)).flatten());
        if let Some(path) = bound {
            return self.resolve(m, path, hops + 1, false);
        }
        let locals = if local { &module.local_globs[..] } else { &[] };
        let globs = module.globs.iter().chain(locals);
        globs
            .filter_map(|glob| self.through_glob(m, glob, name, hops + 1))
            .next()
    }

    /// `name` as brought in by `use glob::*;` in module `m`: from a module, or an enum's
    /// variant (which resolves to the enum).
    fn through_glob(&self, m: usize, glob: &[String], name: &str, hops: usize) -> Option<Found> {
        match self.resolve(m, glob, hops, false)? {
            Found::Module(source) if source != m => self.lookup(source, name, hops + 1, false),
            Found::Item(defined, item) => {
                let variants = self.modules[defined].variants.get(&item)?;
                variants
                    .contains(name)
                    .then_some(Found::Item(defined, item))
            }
            Found::Module(_) => None,
        }
    }

    /// The dependencies between modules: (from, to) -> the items `from` names from `to`.
    fn edges(&self) -> BTreeMap<(usize, usize), BTreeSet<String>> {
        let mut edges: BTreeMap<_, BTreeSet<String>> = BTreeMap::new();
        for (m, module) in self.modules.iter().enumerate() {
            for path in &module.refs {
                if let Some(Found::Item(to, item)) = self.resolve(m, path, 0, true) {
                    if to != m {
                        edges.entry((m, to)).or_default().insert(item);
                    }
                }
            }
        }
        edges
    }

    /// The circles: strongly connected sets of two modules or more, with their edges.
    fn circles(&self) -> Vec<Circle> {
        let edges = self.edges();
        let mut next = vec![Vec::new(); self.modules.len()];
        for &(from, to) in edges.keys() {
            next[from].push(to);
        }
        let components = Tarjan::components(&next);
        let circles = components.into_iter().filter(|c| c.len() > 1);
        circles
            .map(|component| {
                let inside: BTreeSet<usize> = component.into_iter().collect();
                let mut files: Vec<String> = inside.iter().map(|&m| self.shown(m)).collect();
                files.sort();
                let mut list: Vec<Edge> = edges
                    .iter()
                    .filter(|((from, to), _)| inside.contains(from) && inside.contains(to))
                    .map(|(&(from, to), items)| Edge {
                        from: self.shown(from),
                        to: self.shown(to),
                        items: items.iter().cloned().collect(),
                    })
                    .collect();
                list.sort_by(|a, b| (&a.from, &a.to).cmp(&(&b.from, &b.to)));
                Circle {
                    target: self.label.clone(),
                    src: self.src.clone(),
                    files,
                    edges: list,
                }
            })
            .collect()
    }

    /// A module as reports show it: its file under `src/`, then `::inline::path`.
    fn shown(&self, m: usize) -> String {
        let module = &self.modules[m];
        let file = module.file.strip_prefix(&self.src).unwrap_or(&module.file);
        let mut shown = file.display().to_string();
        for name in &module.inline {
            shown.push_str("::");
            shown.push_str(name);
        }
        shown
    }
}

/// Tarjan's strongly connected components of a graph given as each node's successors.
struct Tarjan<'a> {
    next: &'a [Vec<usize>],
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    counter: usize,
    components: Vec<Vec<usize>>,
}

impl Tarjan<'_> {
    fn components(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
        let n = next.len();
        let mut tarjan = Tarjan {
            next,
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            counter: 0,
            components: Vec::new(),
        };
        for v in 0..n {
            if tarjan.index[v].is_none() {
                tarjan.connect(v);
            }
        }
        tarjan.components
    }

    fn connect(&mut self, v: usize) {
        self.index[v] = Some(self.counter);
        self.low[v] = self.counter;
        self.counter += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        for &w in self.next[v].iter() {
            match self.index[w] {
                None => {
                    self.connect(w);
                    self.low[v] = self.low[v].min(self.low[w]);
                }
                Some(index) if self.on_stack[w] => self.low[v] = self.low[v].min(index),
                Some(_) => {}
            }
        }
        if self.index[v] == Some(self.low[v]) {
            let mut component = Vec::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            self.components.push(component);
        }
    }
}

/// One name a `use` brings in: `Name(binding, path)` (no binding for `as _`), or a glob
/// over the module (or enum) at the path.
enum UseLeaf {
    Name(Option<String>, Vec<String>),
    Glob(Vec<String>),
}

/// Flattens a `use` tree (groups, `self`, renames, globs) into its leaves.
fn use_leaves(tree: &UseTree, prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    let joined = |ident: &syn::Ident| {
        let mut path = prefix.clone();
        if ident != "self" {
            path.push(ident.to_string());
        }
        path
    };
    match tree {
        UseTree::Path(p) => use_leaves(&p.tree, joined(&p.ident), out),
        UseTree::Name(n) => {
            let path = joined(&n.ident);
            out.push(UseLeaf::Name(path.last().cloned(), path));
        }
        UseTree::Rename(r) => {
            let bind = (r.rename != "_").then(|| r.rename.to_string());
            out.push(UseLeaf::Name(bind, joined(&r.ident)));
        }
        UseTree::Glob(_) => out.push(UseLeaf::Glob(prefix)),
        UseTree::Group(g) => {
            for tree in &g.items {
                use_leaves(tree, prefix.clone(), out);
            }
        }
    }
}

/// Walks code for what rules 1 and 2 need: the paths it names (macro arguments too, as
/// tokens), the `use`s in function bodies and each function's span. Test code is skipped.
struct Collector {
    file: PathBuf,
    /// The type or trait whose `impl`/definition is being walked, innermost last.
    owner: Vec<String>,
    refs: Vec<Vec<String>>,
    uses: Vec<UseLeaf>,
    fns: Vec<FnSpan>,
}

impl Collector {
    fn record(&mut self, vis: Option<&Visibility>, sig: &Signature, body: &Block, owned: bool) {
        // The item's first token after its attributes: the visibility, else the signature.
        let start = match vis {
            Some(vis) if !matches!(vis, Visibility::Inherited) => vis.span(),
            _ => sig.span(),
        };
        let line = start.start().line;
        let end = body.brace_token.span.close().start().line;
        let name = match self.owner.last() {
            Some(owner) if owned => format!("{owner}::{}", sig.ident),
            _ => sig.ident.to_string(),
        };
        self.fns.push(FnSpan {
            file: self.file.clone(),
            line,
            name,
            lines: end.saturating_sub(line) + 1,
        });
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item(&mut self, item: &'ast Item) {
        if !is_test_only(item_attrs(item)) {
            visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        use_leaves(&item.tree, Vec::new(), &mut self.uses);
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.record(Some(&f.vis), &f.sig, &f.block, false);
        visit::visit_item_fn(self, f);
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.owner.push(type_name(&item.self_ty));
        visit::visit_item_impl(self, item);
        self.owner.pop();
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.owner.push(item.ident.to_string());
        visit::visit_item_trait(self, item);
        self.owner.pop();
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_only(&f.attrs) {
            self.record(Some(&f.vis), &f.sig, &f.block, true);
            visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if is_test_only(&f.attrs) {
            return;
        }
        if let Some(body) = &f.default {
            self.record(None, &f.sig, body, true);
        }
        visit::visit_trait_item_fn(self, f);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let mut segments: Vec<String> = Vec::new();
        if path.leading_colon.is_some() {
            segments.push("::".to_string());
        }
        segments.extend(path.segments.iter().map(|s| s.ident.to_string()));
        self.refs.push(segments);
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        visit::visit_macro(self, mac);
        macro_paths(mac.tokens.clone(), &mut self.refs);
    }
}

/// The `a::b` paths (two segments or more) in a macro's arguments, which are not parsed
/// as Rust: sequences of identifiers joined by `::`, nested groups included.
fn macro_paths(tokens: TokenStream, out: &mut Vec<Vec<String>>) {
    let mut path: Vec<String> = Vec::new();
    let mut colons = 0;
    let flush = |path: &mut Vec<String>, out: &mut Vec<Vec<String>>| {
        if path.len() > 1 {
            out.push(std::mem::take(path));
        }
        path.clear();
    };
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => {
                if colons != 2 {
                    flush(&mut path, out);
                }
                path.push(ident.to_string());
                colons = 0;
            }
            TokenTree::Punct(p) if p.as_char() == ':' && !path.is_empty() && colons < 2 => {
                colons += 1;
            }
            other => {
                flush(&mut path, out);
                colons = 0;
                if let TokenTree::Group(group) = other {
                    macro_paths(group.stream(), out);
                }
            }
        }
    }
    flush(&mut path, out);
}

/// The name of an `impl`'s type, for `Type::method`.
fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
        syn::Type::Reference(r) => Some(type_name(&r.elem)),
        _ => None,
    }
    .unwrap_or_else(|| "_".to_string())
}

/// The `#[path = "..."]` of a module declaration.
fn path_attr(attrs: &[Attribute]) -> Option<String> {
    attrs.iter().find_map(|a| match &a.meta {
        Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// Whether attributes make an item test code: `#[test]` (or `#[some::test]`), or a `cfg`
/// that holds only in test builds.
fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        let test = a.path().segments.last().is_some_and(|s| s.ident == "test");
        let cfg = a.path().is_ident("cfg") && a.parse_args::<Meta>().is_ok_and(|m| needs_test(&m));
        test || cfg
    })
}

/// Whether a cfg predicate needs `test`: `test`, `all(.., test, ..)`, or `any` of such.
fn needs_test(meta: &Meta) -> bool {
    match meta {
        Meta::Path(p) => p.is_ident("test"),
        Meta::List(list) => {
            let parser = Punctuated::<Meta, Token![,]>::parse_terminated;
            let Ok(args) = list.parse_args_with(parser) else {
                return false;
            };
            if list.path.is_ident("all") {
                args.iter().any(needs_test)
            } else if list.path.is_ident("any") {
                !args.is_empty() && args.iter().all(needs_test)
            } else {
                false
            }
        }
        Meta::NameValue(_) => false,
    }
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

#[cfg(test)]
#[path = "structure_tests.rs"]
mod tests;
