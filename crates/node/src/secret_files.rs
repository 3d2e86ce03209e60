//! Files that hold secrets (the etcd password and client key, the first admin token) must
//! be readable by their owner only, like `node.key` and the cluster key file: a node refuses
//! to start on one that others may read, and says how to fix it. Checked once at start.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// `Err` (what is wrong and what to do) if `path` may be read or written by anyone but its
/// owner. `what` names the file's role ("etcd password file").
pub fn check(path: &Path, what: &str) -> Result<(), String> {
    let md = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let mode = md.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{what} {} has mode {mode:o}: others may read it; a secret must be readable by \
             its owner only (chmod 600 {})",
            path.display(),
            path.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A secret readable by others is refused (before, the etcd password file's mode was
    /// never looked at).
    #[test]
    fn secrets_others_may_read_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("etcd.password");
        std::fs::write(&p, "hunter2\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = check(&p, "etcd password file").unwrap_err();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        check(&p, "etcd password file").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        check(&p, "etcd password file").unwrap();
        assert!(check(&dir.path().join("missing"), "x").is_err());
    }
}
