//! Embeds the eBPF object so one binary is all a node needs.
//!
//! `cargo xtask build` compiles `redirect-ebpf` with nightly and passes the object's path in
//! `REDIRECT_EBPF_OBJECT`. A plain `cargo build` (stable, no bpf-linker) embeds an empty object instead;
//! such a binary runs every offline command and refuses `redirect run` with a message saying why.
use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=REDIRECT_EBPF_OBJECT");
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("redirect.bpf.o");
    match env::var_os("REDIRECT_EBPF_OBJECT") {
        Some(path) => {
            let path = PathBuf::from(path);
            println!("cargo:rerun-if-changed={}", path.display());
            fs::copy(&path, &out)
                .unwrap_or_else(|e| panic!("copying eBPF object {}: {e}", path.display()));
        }
        None => fs::write(&out, []).expect("writing empty eBPF object placeholder"),
    }
}
