//! Content negotiation: what the request body is (`Content-Type`) and what the answer
//! should be (`Accept`, plus `output=` in `X-Amzn-SageMaker-Custom-Attributes`, the only
//! other header SageMaker passes through).

use axum::http::{header, HeaderMap, StatusCode};

use crate::config::OutputKind;
use crate::http::error::ApiError;

pub const CUSTOM_ATTRIBUTES: &str = "x-amzn-sagemaker-custom-attributes";

/// How the request body carries the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// The encoded image itself.
    Image,
    /// `{"image": "<base64>"}` or `{"url": "..."}`.
    Json,
}

pub fn body_kind(headers: &HeaderMap) -> Result<BodyKind, ApiError> {
    let unsupported = |what: String| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_content_type",
            format!(
                "{what}; send image/jpeg, image/png, application/x-image, \
                 application/octet-stream, or application/json with {{\"image\": \"<base64>\"}}"
            ),
        )
    };
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Err(unsupported("the request has no Content-Type".into()));
    };
    let essence = essence(value.to_str().unwrap_or_default());
    match essence.as_str() {
        "application/json" => Ok(BodyKind::Json),
        "application/x-image" | "application/octet-stream" => Ok(BodyKind::Image),
        e if e.starts_with("image/") => Ok(BodyKind::Image),
        "" => Err(unsupported("the Content-Type header is empty".into())),
        other => Err(unsupported(format!("Content-Type {other} is not accepted"))),
    }
}

/// The output kind: `Accept` picks PNG or JSON; within PNG, `output=` in the custom
/// attributes (or the pipeline's default) picks cut-out, alpha or trimap.
pub fn output_kind(headers: &HeaderMap, default: OutputKind) -> Result<OutputKind, ApiError> {
    let wanted = match custom_attribute(headers, "output") {
        Some(word) => word.parse::<OutputKind>().map_err(|e| {
            ApiError::bad_request("bad_custom_attribute", format!("output={word}: {e}"))
        })?,
        None => default,
    };
    let Some(accept) = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) else {
        return Ok(wanted);
    };
    let png = |k: OutputKind| {
        if k == OutputKind::Json {
            OutputKind::Cutout
        } else {
            k
        }
    };
    for range in accept.split(',').map(essence) {
        match range.as_str() {
            "" | "*/*" => return Ok(wanted),
            "application/json" => return Ok(OutputKind::Json),
            "image/png" | "image/*" => return Ok(png(wanted)),
            _ => {}
        }
    }
    Err(ApiError::new(
        StatusCode::NOT_ACCEPTABLE,
        "not_acceptable",
        format!("cannot answer with {accept}; accept image/png or application/json"),
    ))
}

/// `key=value` pairs separated by `;` or `,`.
fn custom_attribute(headers: &HeaderMap, key: &str) -> Option<String> {
    let value = headers.get(CUSTOM_ATTRIBUTES)?.to_str().ok()?;
    value.split([';', ',']).find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim().eq_ignore_ascii_case(key)).then(|| v.trim().to_string())
    })
}

fn essence(media: &str) -> String {
    media
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn content_types() {
        assert_eq!(
            body_kind(&headers(&[("content-type", "image/jpeg")])).unwrap(),
            BodyKind::Image
        );
        assert_eq!(
            body_kind(&headers(&[(
                "content-type",
                "Application/JSON; charset=utf-8"
            )]))
            .unwrap(),
            BodyKind::Json
        );
        assert_eq!(
            body_kind(&headers(&[])).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        assert_eq!(
            body_kind(&headers(&[("content-type", "text/plain")]))
                .unwrap_err()
                .status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
    }

    #[test]
    fn accept_and_custom_attributes() {
        let d = OutputKind::Cutout;
        assert_eq!(output_kind(&headers(&[]), d).unwrap(), OutputKind::Cutout);
        assert_eq!(
            output_kind(&headers(&[("accept", "application/json")]), d).unwrap(),
            OutputKind::Json
        );
        assert_eq!(
            output_kind(
                &headers(&[
                    ("accept", "image/png"),
                    (CUSTOM_ATTRIBUTES, "trace=1; output=alpha")
                ]),
                d
            )
            .unwrap(),
            OutputKind::Alpha
        );
        assert_eq!(
            output_kind(
                &headers(&[("accept", "text/html, */*;q=0.1")]),
                OutputKind::Trimap
            )
            .unwrap(),
            OutputKind::Trimap
        );
        assert_eq!(
            output_kind(&headers(&[("accept", "text/html")]), d)
                .unwrap_err()
                .status,
            StatusCode::NOT_ACCEPTABLE
        );
        assert_eq!(
            output_kind(&headers(&[(CUSTOM_ATTRIBUTES, "output=sepia")]), d)
                .unwrap_err()
                .status,
            StatusCode::BAD_REQUEST
        );
    }
}
