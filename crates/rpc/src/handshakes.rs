//! Bounds on connections that have not yet proven who they are, per source host, so that one
//! host cannot hold every connection slot of a server in unfinished handshakes (a TLS
//! handshake never completed, a hello never sent, an API request's headers never sent).
//! Used by the peer protocol's server and by the node's API.
//!
//! A connection takes a [`Pending`] place when it is accepted and gives it back once it is
//! authenticated (or closed). A host already holding `per_source_max` places gets its next
//! connection closed at once, before any byte of it is read; other hosts are not affected.
//! Per connection: one hash-map update under a mutex at accept and one when it is done.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Unauthenticated connections, counted per source host.
#[derive(Clone)]
pub struct Handshakes {
    inner: Arc<Inner>,
}

struct Inner {
    per_source_max: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

/// A place held by one connection that has not authenticated yet; dropping it frees it.
pub struct Pending {
    inner: Arc<Inner>,
    source: IpAddr,
}

/// The host a source address stands for: an IPv4 address (IPv4-mapped IPv6 included), or
/// an IPv6 address's /64 (one host owns a whole /64, and may use any address in it).
pub fn source_host(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

impl Handshakes {
    /// At most `per_source_max` unauthenticated connections per source host (at least one).
    pub fn new(per_source_max: usize) -> Handshakes {
        Handshakes {
            inner: Arc::new(Inner {
                per_source_max: per_source_max.max(1),
                counts: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A place for a new connection from `addr`; `None` if its host holds every place it
    /// may (the connection should be closed at once).
    pub fn enter(&self, addr: IpAddr) -> Option<Pending> {
        let source = source_host(addr);
        let mut c = self.inner.counts.lock().expect("handshake counts poisoned");
        let n = c.entry(source).or_insert(0);
        if *n >= self.inner.per_source_max {
            return None;
        }
        *n += 1;
        Some(Pending {
            inner: self.inner.clone(),
            source,
        })
    }

    /// How many unauthenticated connections `addr`'s host holds now.
    pub fn pending(&self, addr: IpAddr) -> usize {
        let c = self.inner.counts.lock().expect("handshake counts poisoned");
        c.get(&source_host(addr)).copied().unwrap_or(0)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut c = self.inner.counts.lock().expect("handshake counts poisoned");
        if let Some(n) = c.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_host_has_its_own_places_and_gets_them_back() {
        let h = Handshakes::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = h.enter(a).unwrap();
        let _a2 = h.enter(a).unwrap();
        assert!(h.enter(a).is_none(), "a third from the same host");
        // The IPv4-mapped form is the same host.
        assert!(h.enter("::ffff:10.0.0.1".parse().unwrap()).is_none());
        let _b1 = h.enter(b).expect("another host is not affected");
        drop(a1);
        assert_eq!(h.pending(a), 1);
        let _a3 = h.enter(a).expect("a place given back is free again");
        // An IPv6 host is its /64.
        let v6a: IpAddr = "fd00:1:2:3::10".parse().unwrap();
        let v6b: IpAddr = "fd00:1:2:3:ffff::20".parse().unwrap();
        let _x = h.enter(v6a).unwrap();
        let _y = h.enter(v6b).unwrap();
        assert!(h.enter(v6a).is_none());
        assert!(h.enter("fd00:1:2:4::1".parse().unwrap()).is_some());
    }
}
