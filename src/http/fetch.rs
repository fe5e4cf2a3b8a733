//! Fetching an image named by `url` in a JSON body. Off unless the operator lists the
//! hosts that may be fetched: a server that fetches arbitrary URLs is a request-forgery
//! hole into its own network. Redirects are not followed (they could leave the list);
//! size and time are bounded.

use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;

use crate::error::ApiError;

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
        if !self.allowed_hosts.contains(&host) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "url_not_allowed",
                format!("fetching from {host} is not allowed by this server"),
            ));
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
        let too_large = || {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!(
                    "the image at `url` is over the limit of {} bytes",
                    self.max_bytes
                ),
            )
        };
        if response
            .content_length()
            .is_some_and(|n| n > self.max_bytes as u64)
        {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| failed(e.to_string()))? {
            if body.len() + chunk.len() > self.max_bytes {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(body))
    }
}
