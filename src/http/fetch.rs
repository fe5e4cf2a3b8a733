//! Fetching an image named by `url` in a JSON body. Off unless the operator lists the
//! hosts that may be fetched: a server that fetches arbitrary URLs is a request-forgery
//! hole into its own network. A listed host *name* must resolve to public addresses,
//! and the connection goes only to those (the client's resolver drops the others, so a
//! name cannot be rebound to an internal address between the check and the connect); a
//! listed IP literal is the operator's explicit choice and is fetched as is. Redirects
//! are not followed (they could leave the list); size and time are bounded.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;

use crate::http::error::ApiError;

pub struct UrlFetcher {
    client: reqwest::Client,
    allowed_hosts: Vec<String>,
    max_bytes: usize,
}

impl UrlFetcher {
    /// `None` when `allowed_hosts` is empty: fetching stays off.
    pub fn new(allowed_hosts: &[String], timeout: Duration, max_bytes: usize) -> Option<Self> {
        let allowed_hosts: Vec<String> = allowed_hosts
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        if allowed_hosts.is_empty() {
            return None;
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            // The allow-list names hosts; a proxy from the environment would stand between.
            .no_proxy()
            .dns_resolver(Arc::new(PublicOnly))
            .build()
            .ok()?;
        Some(Self {
            client,
            allowed_hosts,
            max_bytes,
        })
    }

    pub async fn fetch(&self, raw: &str) -> Result<Bytes, ApiError> {
        let url = url::Url::parse(raw)
            .map_err(|e| ApiError::bad_request("bad_url", format!("`url` is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ApiError::bad_request(
                "bad_url",
                "`url` must be http or https",
            ));
        }
        let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
        let not_allowed =
            |why: String| ApiError::new(StatusCode::FORBIDDEN, "url_not_allowed", why);
        if !self.allowed_hosts.contains(&host) {
            return Err(not_allowed(format!(
                "fetching from {host} is not allowed by this server"
            )));
        }
        if let Some(url::Host::Domain(name)) = url.host() {
            // Said as a 403 here; the resolver enforces it again at connect time.
            public_addresses(name, url.port_or_known_default().unwrap_or(80))
                .await
                .map_err(not_allowed)?;
        }
        let failed = |why: String| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "fetch_failed",
                format!("fetching `url` failed: {why}"),
            )
        };
        let mut response = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| failed(e.to_string()))?;
        if !response.status().is_success() {
            return Err(failed(format!("the server answered {}", response.status())));
        }
        let too_large = || ApiError::payload_too_large("the image at `url`", self.max_bytes);
        let declared = response.content_length();
        if declared.is_some_and(|n| n > self.max_bytes as u64) {
            return Err(too_large());
        }
        // Sized once from the declared length (already checked against the limit).
        let mut body = Vec::with_capacity(declared.map_or(0, |n| n as usize));
        while let Some(chunk) = response.chunk().await.map_err(|e| failed(e.to_string()))? {
            if body.len() + chunk.len() > self.max_bytes {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(body))
    }
}

/// The public addresses `name` resolves to; an error naming them when there is none.
async fn public_addresses(name: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
    let all: Vec<SocketAddr> = tokio::net::lookup_host((name, port))
        .await
        .map_err(|e| format!("{name} does not resolve: {e}"))?
        .collect();
    let public: Vec<SocketAddr> = all.iter().copied().filter(|a| is_public(a.ip())).collect();
    if public.is_empty() {
        let listed: Vec<String> = all.iter().map(|a| a.ip().to_string()).collect();
        return Err(format!(
            "{name} resolves only to internal addresses ({}); list an IP literal to fetch \
             from inside the network on purpose",
            listed.join(", ")
        ));
    }
    Ok(public)
}

/// Not loopback, private, link-local, shared (CGNAT), unspecified, multicast,
/// documentation or otherwise reserved: an address on the public internet.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b)) // shared address space, RFC 6598
                || (a == 192 && b == 0) // IETF protocol assignments
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00 // unique local
                || (first & 0xffc0) == 0xfe80 // link-local
                || first == 0x2001 && v6.segments()[1] == 0x0db8) // documentation
        }
    }
}

/// The client's resolver: the public addresses of a name, never the internal ones.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let addresses = public_addresses(name.as_str(), 0).await?;
            Ok(Box::new(addresses.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses_are_not_public() {
        for internal in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254", // the cloud metadata service
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
        ] {
            assert!(!is_public(internal.parse().unwrap()), "{internal}");
        }
        for public in [
            "8.8.8.8",
            "52.94.236.248",
            "2606:4700:4700::1111",
            "::ffff:1.1.1.1",
        ] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    #[tokio::test]
    async fn a_name_that_resolves_only_inside_is_refused_with_its_addresses() {
        let err = public_addresses("localhost", 80).await.unwrap_err();
        assert!(err.contains("resolves only to internal addresses"), "{err}");
        assert!(err.contains("127.0.0.1") || err.contains("::1"), "{err}");
    }
}
