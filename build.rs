//! Builds ebpf/datapath.bpf.o with clang-19 when it is installed (same
//! flags as ebpf/Makefile, so the result is byte-identical to the committed
//! object). If clang-19 is installed and the compile fails, the build fails
//! with clang's diagnostics: a broken edit of the C never falls back to the
//! committed object. Only when clang-19 is not installed at all (command
//! not found) is the committed object used, so `cargo build` works on a
//! machine without clang. EBPF_USE_PREBUILT=1 skips clang.
use std::io::ErrorKind;
use std::path::PathBuf;
use std::process::Command;

/// The Debian multiarch directory for the target (asm/types.h and friends
/// live in /usr/include/<multiarch>); ebpf/Makefile maps `uname -m` the
/// same way.
fn multiarch() -> String {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let endian = std::env::var("CARGO_CFG_TARGET_ENDIAN").unwrap_or_default();
    match (arch.as_str(), endian.as_str()) {
        ("x86", _) => "i386-linux-gnu".into(),
        ("arm", _) => "arm-linux-gnueabihf".into(),
        ("powerpc64", "little") => "powerpc64le-linux-gnu".into(),
        (a, _) => format!("{a}-linux-gnu"),
    }
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("ebpf");
    let committed = dir.join("datapath.bpf.o");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("datapath.bpf.o");
    // datapath.bpf.c is the one translation unit; it includes datapath.h,
    // lib/*.h and prog/*.h (ebpf/Makefile's SRCS). The folders are watched
    // (a file added or removed) and so is each file in them.
    for f in [
        "datapath.bpf.c",
        "datapath.h",
        "datapath.bpf.o",
        "lib",
        "prog",
    ] {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    for sub in ["lib", "prog"] {
        // Missing (a copy without the C): nothing to watch; clang, if
        // run, reports the missing includes.
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join(sub))
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        for f in files {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }
    println!("cargo:rerun-if-env-changed=EBPF_USE_PREBUILT");
    let use_prebuilt = std::env::var("EBPF_USE_PREBUILT").is_ok_and(|v| v == "1");
    if use_prebuilt {
        std::fs::copy(&committed, &out)
            .expect("EBPF_USE_PREBUILT=1: no committed ebpf/datapath.bpf.o");
        return;
    }
    let clang = Command::new("clang-19")
        .current_dir(&dir)
        .args(["-O2", "-g", "-target", "bpf"])
        .arg(format!("-I/usr/include/{}", multiarch()))
        .arg(format!("-ffile-prefix-map={}=.", dir.display()))
        .args(["-c", "datapath.bpf.c", "-o"])
        .arg(&out)
        .output();
    match clang {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            println!(
                "cargo:warning=clang-19 not found: using the committed ebpf/datapath.bpf.o (edits of ebpf/ are not compiled)"
            );
            std::fs::copy(&committed, &out)
                .expect("no clang-19 and no committed ebpf/datapath.bpf.o");
        }
        Err(e) => panic!("running clang-19: {e}"),
        Ok(o) if !o.status.success() => {
            panic!(
                "clang-19 failed to compile ebpf/datapath.bpf.c ({}):\n{}{}",
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Ok(o) => {
            // Warnings are not errors, but should be seen.
            for l in String::from_utf8_lossy(&o.stderr).lines() {
                println!("cargo:warning=clang-19: {l}");
            }
            if std::fs::read(&out).ok() != std::fs::read(&committed).ok() {
                println!(
                    "cargo:warning=ebpf/datapath.bpf.o is stale: run `make -C ebpf` and commit the object"
                );
            }
        }
    }
}
