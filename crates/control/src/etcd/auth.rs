//! etcd's username/password authentication as the JSON gateway offers it: a token from
//! `/v3/auth/authenticate`, sent as `Authorization: <token>` on every request, and renewed
//! when etcd stops accepting it (simple tokens expire after `--auth-token-ttl`, 300 s by
//! default, and are dropped when the user's password changes or etcd restarts).
//!
//! # Why re-sending a request refused for its token is safe
//!
//! The client never re-sends a request that etcd may have applied (a transaction must not
//! run twice). A request refused for its token was not applied, because etcd checks the
//! token at two points, both before it changes anything:
//!
//! * Before proposing the request to raft, etcd resolves the token to a user. An unknown or
//!   expired token is refused there ("invalid auth token", HTTP 401); nothing was proposed.
//! * When applying, etcd checks the user and the auth store's revision before running the
//!   operation, and refuses without running it ("user name is empty", "revision of auth store
//!   is old").
//!
//! So on exactly these refusals the client authenticates again and sends the same request
//! once more. Every other failure (timeout, connection lost, any other error) is returned as
//! it was, as without authentication.

/// What the client holds to authenticate its requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Token {
    /// Not authenticated yet (or the last attempt failed).
    Unknown,
    /// etcd said authentication is not enabled: requests go without a token, and the first
    /// refusal for a missing user (auth enabled since) authenticates.
    NotNeeded,
    /// A token etcd issued.
    Valid(String),
}

impl Token {
    /// The `Authorization` header value to send, if any.
    pub(crate) fn header(&self) -> Option<String> {
        match self {
            Token::Valid(t) => Some(t.clone()),
            Token::Unknown | Token::NotNeeded => None,
        }
    }
}

/// An etcd user and the token it currently holds, shared by clones of one client.
pub(crate) struct Credentials {
    pub(crate) user: String,
    pub(crate) password: String,
    /// Held while authenticating, so that requests that found the same token stale renew it
    /// once between them rather than once each.
    pub(crate) token: tokio::sync::Mutex<Token>,
}

impl Credentials {
    pub(crate) fn new(user: String, password: String) -> Credentials {
        Credentials {
            user,
            password,
            token: tokio::sync::Mutex::new(Token::Unknown),
        }
    }
}

/// True if etcd refused a request because of its token or a missing user: the refusals
/// that happen before anything is applied (see the module docs). `status` is the HTTP status
/// when there is one (a watch reports its refusal inside a 200 stream).
pub(crate) fn is_token_refusal(status: Option<u16>, message: &str) -> bool {
    status == Some(401)
        || message.contains("invalid auth token")
        || message.contains("user name is empty")
        || message.contains("revision of auth store is old")
}

/// True if etcd answered an authenticate call by saying authentication is off.
pub(crate) fn is_auth_not_enabled(message: &str) -> bool {
    message.contains("authentication is not enabled")
}

/// True if etcd refused the username or password.
pub(crate) fn is_bad_credentials(message: &str) -> bool {
    message.contains("authentication failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_refusals_are_recognised_and_nothing_else() {
        assert!(is_token_refusal(Some(401), "whatever"));
        assert!(is_token_refusal(Some(401), ""));
        assert!(is_token_refusal(
            None,
            "etcd canceled the watch: rpc error: code = Unauthenticated desc = etcdserver: \
             invalid auth token"
        ));
        assert!(is_token_refusal(
            Some(400),
            "etcdserver: user name is empty"
        ));
        assert!(is_token_refusal(
            Some(400),
            "etcdserver: revision of auth store is old"
        ));
        // A refusal by permission is not about the token: retrying would not help.
        assert!(!is_token_refusal(
            Some(403),
            "etcdserver: permission denied"
        ));
        assert!(!is_token_refusal(Some(400), "etcdserver: lease not found"));
        assert!(!is_token_refusal(Some(500), ""));
    }

    #[test]
    fn only_a_valid_token_is_sent() {
        assert_eq!(Token::Valid("t.1".into()).header().as_deref(), Some("t.1"));
        assert_eq!(Token::NotNeeded.header(), None);
        assert_eq!(Token::Unknown.header(), None);
    }
}
