//! Builds ebpf/datapath.bpf.o with clang-19 when it is installed (same
//! flags as ebpf/Makefile, so the result is byte-identical to the committed
//! object); otherwise uses the committed object, so `cargo build` works on
//! a machine without clang. EBPF_USE_PREBUILT=1 skips clang.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("ebpf");
    let committed = dir.join("datapath.bpf.o");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("datapath.bpf.o");
    for f in ["datapath.bpf.c", "datapath.h", "datapath.bpf.o"] {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    println!("cargo:rerun-if-env-changed=EBPF_USE_PREBUILT");
    let use_prebuilt = std::env::var("EBPF_USE_PREBUILT").is_ok_and(|v| v == "1");
    let compiled = !use_prebuilt
        && Command::new("clang-19")
            .current_dir(&dir)
            .args([
                "-O2",
                "-g",
                "-target",
                "bpf",
                "-I/usr/include/x86_64-linux-gnu",
            ])
            .arg(format!("-ffile-prefix-map={}=.", dir.display()))
            .args(["-c", "datapath.bpf.c", "-o"])
            .arg(&out)
            .status()
            .is_ok_and(|s| s.success());
    if !compiled {
        std::fs::copy(&committed, &out).expect("no clang-19 and no committed ebpf/datapath.bpf.o");
    } else if std::fs::read(&out).ok() != std::fs::read(&committed).ok() {
        println!(
            "cargo:warning=ebpf/datapath.bpf.o is stale: run `make -C ebpf` and commit the object"
        );
    }
}
