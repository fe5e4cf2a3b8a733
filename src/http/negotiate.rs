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

/// `Accept` picks an image (`image/png`, `image/webp`) or JSON, negotiated as RFC 9110
/// says: each media type weighs what its most specific matching range says (`q=`, 1 when
/// absent; `q=0`: not acceptable), the heaviest wins, and among equals the answer without
/// an `Accept` comes first; nothing acceptable is a 406. `output=` in the custom
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
    let json = Wanted {
        kind: OutputKind::Json,
        format,
    };
    // What celer can answer, the default answer first: among equally acceptable media
    // types the server picks, and it picks what it would send without an `Accept`.
    let default_type = match (kind, format) {
        (OutputKind::Json, _) => JSON,
        (_, ImageFormat::Png) => PNG,
        (_, ImageFormat::Webp) => WEBP,
    };
    let offers = [
        (default_type, wanted),
        (PNG, image(ImageFormat::Png)),
        (WEBP, image(ImageFormat::Webp)),
        (JSON, json),
    ];
    let ranges = media_ranges(accept);
    let mut best: Option<(f32, Wanted)> = None;
    for (media, answer) in offers {
        let q = quality(&ranges, media);
        if q > 0.0 && best.is_none_or(|(b, _)| q > b) {
            best = Some((q, answer));
        }
    }
    best.map(|(_, answer)| answer).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_ACCEPTABLE,
            "not_acceptable",
            format!(
                "cannot answer with {accept}; accept image/png, image/webp or application/json"
            ),
        )
    })
}

const PNG: (&str, &str) = ("image", "png");
const WEBP: (&str, &str) = ("image", "webp");
const JSON: (&str, &str) = ("application", "json");

/// One media range of an `Accept` header: type, subtype (either may be `*`) and its
/// weight (RFC 9110, 12.5.1; 1 when absent).
#[derive(Debug, Clone, PartialEq)]
struct MediaRange {
    kind: String,
    subtype: String,
    q: f32,
}

/// The ranges of an `Accept` value; a range that does not parse is left out, a weight
/// that does not parse counts as 1 (lenient, as browsers' servers are).
fn media_ranges(accept: &str) -> Vec<MediaRange> {
    accept
        .split(',')
        .filter_map(|range| {
            let mut parts = range.split(';');
            let media = parts.next()?.trim().to_ascii_lowercase();
            let (kind, subtype) = media.split_once('/')?;
            let (kind, subtype) = (kind.trim(), subtype.trim());
            if kind.is_empty() || subtype.is_empty() || (kind == "*" && subtype != "*") {
                return None;
            }
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, v)| v.trim().parse::<f32>().ok())
                .map_or(1.0, |q| q.clamp(0.0, 1.0));
            Some(MediaRange {
                kind: kind.to_string(),
                subtype: subtype.to_string(),
                q,
            })
        })
        .collect()
}

/// The weight `ranges` give `(kind, subtype)`: that of the most specific range matching it
/// (`type/subtype` over `type/*` over `*/*`), 0 when none does. An empty `Accept` (no
/// ranges) accepts anything.
fn quality(ranges: &[MediaRange], (kind, subtype): (&str, &str)) -> f32 {
    if ranges.is_empty() {
        return 1.0;
    }
    ranges
        .iter()
        .filter_map(|r| {
            let specificity = match (r.kind.as_str(), r.subtype.as_str()) {
                (k, s) if k == kind && s == subtype => 2,
                (k, "*") if k == kind => 1,
                ("*", "*") => 0,
                _ => return None,
            };
            Some((specificity, r.q))
        })
        .max_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)))
        .map_or(0.0, |(_, q)| q)
}

/// `key=value` pairs separated by `;` or `,`.
pub(super) fn custom_attribute(headers: &HeaderMap, key: &str) -> Option<String> {
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

    /// RFC 9110's rules, 12.5.1: weights, the most specific range, `q=0`.
    #[test]
    fn accept_weights_are_honoured() {
        let d = OutputKind::Cutout;
        let w = |kind, format| Wanted { kind, format };
        let png = w(OutputKind::Cutout, ImageFormat::Png);
        let webp = w(OutputKind::Cutout, ImageFormat::Webp);
        let json = w(OutputKind::Json, ImageFormat::Png);
        for (accept, want) in [
            ("image/webp;q=0, image/png;q=1", png),
            ("image/webp;q=0.2, image/png;q=0.9", png),
            ("image/png;q=0.2, image/webp;q=0.9", webp),
            ("image/png;q=0.5, application/json", json),
            ("*/*;q=0.1, application/json;q=0.5", json),
            // The most specific range rules: image/webp excluded, image/* takes PNG.
            ("image/*, image/webp;q=0", png),
            ("image/*;q=0.3, image/webp", webp),
            ("application/*", json),
            ("IMAGE/WEBP ; Q=0.7", webp),
            // Equal weights: the answer without an Accept.
            ("image/png;q=0.5, image/webp;q=0.5", png),
            ("", png),
        ] {
            let h = HeaderMap::from_iter([(header::ACCEPT, HeaderValue::from_static(accept))]);
            assert_eq!(wanted(&h, d).unwrap(), want, "Accept: {accept}");
        }
        // format=webp makes WebP the answer without an Accept, so it wins a tie.
        assert_eq!(
            wanted(
                &headers(&[
                    ("accept", "image/png;q=0.5, image/webp;q=0.5"),
                    (CUSTOM_ATTRIBUTES, "format=webp")
                ]),
                d
            )
            .unwrap(),
            webp
        );
        for accept in ["image/webp;q=0", "*/*;q=0", "text/html, image/png;q=0"] {
            let h = HeaderMap::from_iter([(header::ACCEPT, HeaderValue::from_static(accept))]);
            let e = wanted(&h, d).unwrap_err();
            assert_eq!(
                (e.status, e.code),
                (StatusCode::NOT_ACCEPTABLE, "not_acceptable"),
                "Accept: {accept}"
            );
        }
    }

    #[test]
    fn media_ranges_parse_leniently() {
        let ranges = media_ranges("image/png;level=1;q=0.4, bogus, */png, text/*;q=x");
        assert_eq!(
            ranges,
            [
                MediaRange {
                    kind: "image".into(),
                    subtype: "png".into(),
                    q: 0.4
                },
                MediaRange {
                    kind: "text".into(),
                    subtype: "*".into(),
                    q: 1.0
                },
            ]
        );
    }

    #[test]
    fn gif_format_is_refused() {
        let d = OutputKind::Cutout;
        let e = wanted(&headers(&[(CUSTOM_ATTRIBUTES, "format=gif")]), d).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "bad_custom_attribute")
        );
    }
}
