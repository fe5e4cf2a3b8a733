//! Content negotiation: what the request body is (`Content-Type`) and what the answer
//! should be (`Accept`, plus `output=` and `format=` in
//! `X-Amzn-SageMaker-Custom-Attributes`, the header SageMaker passes for a model's own
//! options).

use axum::http::{header, HeaderMap, StatusCode};

use crate::codec::ImageFormat;
use crate::http::error::ApiError;
use crate::spec::OutputKind;

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

/// What the answer is: an output kind and, for an image, its encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub kind: OutputKind,
    /// How the cut-out, alpha or trimap is encoded (JSON's images are PNG).
    pub format: ImageFormat,
}

/// `Accept` picks an image (`image/png`, `image/webp`) or JSON; `output=` in the custom
/// attributes (or the pipeline's default) picks cut-out, alpha or trimap, `output=webp`
/// being the cut-out as WebP; `format=png|webp` the encoding where `Accept` leaves it open.
pub fn wanted(headers: &HeaderMap, default: OutputKind) -> Result<Wanted, ApiError> {
    let bad = |what: String| ApiError::bad_request("bad_custom_attribute", what);
    let mut format = match custom_attribute(headers, "format") {
        None => ImageFormat::Png,
        Some(word) => match word.to_ascii_lowercase().as_str() {
            "png" => ImageFormat::Png,
            "webp" => ImageFormat::Webp,
            _ => return Err(bad(format!("format={word}: expected png or webp"))),
        },
    };
    let kind = match custom_attribute(headers, "output") {
        Some(word) if word.eq_ignore_ascii_case("webp") => {
            format = ImageFormat::Webp;
            OutputKind::Cutout
        }
        Some(word) => word
            .parse::<OutputKind>()
            .map_err(|e| bad(format!("output={word}: {e} (or webp: the cut-out as WebP)")))?,
        None => default,
    };
    let wanted = Wanted { kind, format };
    let Some(accept) = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) else {
        return Ok(wanted);
    };
    let image = |format: ImageFormat| Wanted {
        kind: if kind == OutputKind::Json {
            OutputKind::Cutout
        } else {
            kind
        },
        format,
    };
    for range in accept.split(',').map(essence) {
        match range.as_str() {
            "" | "*/*" => return Ok(wanted),
            "application/json" => {
                return Ok(Wanted {
                    kind: OutputKind::Json,
                    format,
                })
            }
            "image/png" => return Ok(image(ImageFormat::Png)),
            "image/webp" => return Ok(image(ImageFormat::Webp)),
            "image/*" => return Ok(image(format)),
            _ => {}
        }
    }
    Err(ApiError::new(
        StatusCode::NOT_ACCEPTABLE,
        "not_acceptable",
        format!("cannot answer with {accept}; accept image/png, image/webp or application/json"),
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

    fn output_kind(headers: &HeaderMap, default: OutputKind) -> Result<OutputKind, ApiError> {
        wanted(headers, default).map(|w| w.kind)
    }

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

    #[test]
    fn webp_by_accept_or_custom_attributes() {
        let d = OutputKind::Cutout;
        let w = |kind, format| Wanted { kind, format };
        let webp = ImageFormat::Webp;
        assert_eq!(
            wanted(&headers(&[("accept", "image/webp")]), d).unwrap(),
            w(OutputKind::Cutout, webp)
        );
        assert_eq!(
            wanted(&headers(&[(CUSTOM_ATTRIBUTES, "output=webp")]), d).unwrap(),
            w(OutputKind::Cutout, webp)
        );
        assert_eq!(
            wanted(
                &headers(&[
                    ("accept", "image/*"),
                    (CUSTOM_ATTRIBUTES, "output=alpha;format=webp")
                ]),
                d
            )
            .unwrap(),
            w(OutputKind::Alpha, webp)
        );
        // Accept names the encoding, over the attribute.
        assert_eq!(
            wanted(
                &headers(&[("accept", "image/png"), (CUSTOM_ATTRIBUTES, "output=webp")]),
                d
            )
            .unwrap(),
            w(OutputKind::Cutout, ImageFormat::Png)
        );
        assert_eq!(
            wanted(&headers(&[]), d).unwrap(),
            w(OutputKind::Cutout, ImageFormat::Png)
        );
        let e = wanted(&headers(&[(CUSTOM_ATTRIBUTES, "format=gif")]), d).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "bad_custom_attribute")
        );
    }
}
