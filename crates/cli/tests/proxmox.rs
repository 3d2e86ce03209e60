//! The Proxmox VE storage plugin (`packaging/proxmox/ConvergePlugin.pm`, docs/VMS.md)
//! against a real lab: Perl's syntax check of the module, then its test
//! (`packaging/proxmox/t/plugin.t`), which calls the plugin the way Proxmox VE does —
//! alloc, list, the NBD path and blockdev options opened by qemu-io and qemu-img, snapshot,
//! rollback, linked clone, resize, status, free, refusals — against this lab. What needs a
//! Proxmox VE host (qemu-server starting a VM from it, the GUI) is not tested here.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

#[test]
fn the_proxmox_plugin_manages_volumes_of_a_real_cluster() {
    require_tools();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/proxmox");
    let o = Command::new("perl")
        .arg("-I")
        .arg(dir.join("t/lib"))
        .arg("-c")
        .arg(dir.join("ConvergePlugin.pm"))
        .output()
        .expect("perl");
    assert!(
        o.status.success(),
        "perl -c: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    let lab = Lab::up(3, &["--ram"]);
    let env = lab.json(&["lab", "env"]);
    let socket = lab.lab_json()["nodes"][0]["nbd_socket"]
        .as_str()
        .unwrap()
        .to_string();
    let o = Command::new("perl")
        .arg(dir.join("t/plugin.t"))
        .env("CONVERGE_API", env["CONVERGE_API"].as_str().unwrap())
        .env("CONVERGE_TOKEN", env["CONVERGE_TOKEN"].as_str().unwrap())
        .env("CONVERGE_CA", env["CONVERGE_CA"].as_str().unwrap())
        .env("CONVERGE_CLI", converge_bin())
        .env("CONVERGE_SOCKET", &socket)
        .output()
        .expect("perl t/plugin.t");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && !out.contains("not ok"),
        "plugin.t failed:\n{out}\n{err}"
    );
    assert!(out.contains("1..") && out.contains("ok 30"), "{out}\n{err}");
}
