//! `POST /invocations`: body -> image bytes -> decode (blocking pool) -> device stages
//! (the router, then a replica) -> composite + encode (blocking pool) -> response. The
//! async handler only waits: JSON parsing, base64 and decoding run on the blocking pool
//! too, and only a `url` fetch is awaited in between. `run_image` and the body, decode and
//! blocking helpers are the request path the Open Inference Protocol's `infer` (v2.rs)
//! shares: one admission, deadline and set of limits for both.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use serde::Deserialize;

use super::access;
use super::answer_time::{Allowance, AnswerKind};
use super::error::ApiError;
use super::negotiate::{body_kind, wanted, BodyKind};
use super::urgency;
use super::AppState;
use crate::codec;
use crate::codec::decode::{self, DecodeLimits};
use crate::host::work_pool::WorkPool;
use crate::matte::{MattePlanes, Planes, StageTimings};
use crate::pixels::{HostAlloc, RgbPixels};
use crate::replica::{MatteJob, MatteOutput};
use crate::sched::{Admission, Terms, Work};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonBody {
    image: Option<String>,
    url: Option<String>,
}

pub async fn invocations(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let terms = urgency::Asked::from_custom_attributes(&headers)?
        .terms(Instant::now(), state.limits.deadline)?;
    let kind = body_kind(&headers)?;
    let wanted = wanted(&headers, state.default_output)?;
    let output = wanted.kind;
    let (admission, bytes) = admit_and_read(&state, &headers, body).await?;
    let planes = codec::planes_of(output);
    let answer = AnswerKind::Image {
        output,
        format: wanted.format,
    };
    if kind == BodyKind::Image {
        refuse_unreachable_before_decoding(&state, &bytes, planes, &terms, answer)?;
    }
    let limits = state.limits.decode;
    let pixels = state.pixels.clone();
    let checking = state.clone();
    let source = blocking(&state.work, move || match kind {
        BodyKind::Image => timed_decode(&bytes, &limits, pixels.as_ref()).map(Source::Decoded),
        BodyKind::Json => match json_image(&bytes)? {
            JsonImage::Inline(encoded) => {
                // Its base64 undone here, off the executor: refused before its decode
                // as an image body is.
                refuse_unreachable_before_decoding(&checking, &encoded, planes, &terms, answer)?;
                timed_decode(&encoded, &limits, pixels.as_ref()).map(Source::Decoded)
            }
            JsonImage::Url(url) => Ok(Source::Url(url)),
        },
    })
    .await?;
    let (image, decode_time) = match source {
        Source::Decoded(decoded) => decoded,
        Source::Url(url) => {
            let fetcher = state.fetcher.as_ref().ok_or_else(|| {
                ApiError::bad_request(
                    "url_fetch_disabled",
                    "this server does not fetch URLs; send the image itself (`image` in base64, or the raw bytes)",
                )
            })?;
            let encoded = fetcher.fetch(&url).await?;
            refuse_unreachable_before_decoding(&state, &encoded, planes, &terms, answer)?;
            let pixels = state.pixels.clone();
            blocking(&state.work, move || {
                timed_decode(&encoded, &limits, pixels.as_ref())
            })
            .await?
        }
    };
    let served = run_image(&state, admission, image, decode_time, planes, terms, answer).await?;

    let Served {
        output: out,
        mut inference,
        answer,
    } = served;
    let queued = inference.queued;
    let dimensions = out.planes.dimensions();
    let (rendered, timings) = blocking(&state.work, move || {
        let mut timings = out.timings;
        codec::render_as(&out.planes, output, wanted.format, &mut timings)
            .map(|r| (r, timings))
            .map_err(ApiError::internal)
    })
    .await?;
    inference.encoded(timings);
    answer.answered(inference.run_ended());
    state
        .hosting
        .check_response(rendered.body.len(), wanted, dimensions)?;

    let mut response = (StatusCode::OK, rendered.body).into_response();
    response.extensions_mut().insert(inference);
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(rendered.content_type),
    );
    if state.server_timing {
        if let Ok(v) = HeaderValue::from_str(&server_timing(queued, &timings)) {
            h.insert("server-timing", v);
        }
    }
    Ok(response)
}

/// What a device made of one image, and where and how long it waited and ran.
pub(super) struct Served {
    pub output: MatteOutput,
    pub inference: access::Inference,
    /// The time kept for the answer after the run; told how long it took once made.
    pub answer: Allowance,
}

impl Served {
    /// Makes the answer from the planes with `encode` on the blocking pool, timed as the
    /// encode stage; the answer, what `Inference` says of the request, and the image's
    /// dimensions.
    pub async fn encode<T: Send + 'static>(
        self,
        pool: &WorkPool,
        encode: impl FnOnce(&MattePlanes) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<(T, access::Inference, (u32, u32)), ApiError> {
        let (mut inference, out, allowance) = (self.inference, self.output, self.answer);
        let (answer, timings, dimensions) = blocking(pool, move || {
            let mut timings = out.timings;
            let t = Instant::now();
            let answer = encode(&out.planes)?;
            timings.encode = t.elapsed();
            Ok((answer, timings, out.planes.dimensions()))
        })
        .await?;
        inference.encoded(timings);
        allowance.answered(inference.run_ended());
        Ok((answer, inference, dimensions))
    }
}

/// A request that could not finish by its deadline is refused from its header's size,
/// before its decode: under a client's retries, refusals that each decoded a 12 MP photo
/// (27 ms of a core) took the cores from the runs, which slowed, and so refused more.
pub(super) fn refuse_unreachable_before_decoding(
    state: &AppState,
    bytes: &[u8],
    planes: Planes,
    terms: &Terms,
    answer: AnswerKind,
) -> Result<(), ApiError> {
    if let Some((width, height)) = decode::dimensions(bytes) {
        let work = Work::of_image(width, height, planes.cutout);
        let answer = state.answers.allowance(answer, work).kept();
        let terms = terms.with_work(work).with_answer(answer);
        state.scheduler.check_deadline(&terms)?;
    }
    Ok(())
}

/// The part of the request path every protocol shares: an admitted, decoded image
/// through the router to a replica and back, under the request's terms (its deadline
/// and priority; its work, the image's pixels and whether it is composited, is priced
/// here, and the time its answer, made as `answer`, takes after the run is kept off its
/// deadline). The admission comes from `admit_and_read`, so that overload is answered
/// at once.
pub(super) async fn run_image(
    state: &AppState,
    admission: Admission,
    image: RgbPixels,
    decode_time: Duration,
    planes: Planes,
    terms: Terms,
    answer: AnswerKind,
) -> Result<Served, ApiError> {
    // Called as soon as the image is decoded.
    let decoded_at = Instant::now();
    let timings = StageTimings {
        decode: decode_time,
        ..StageTimings::default()
    };
    let job = MatteJob::new(Arc::new(image), timings, planes);
    let work = job.work();
    let allowance = state.answers.allowance(answer, work);
    let terms = terms.with_work(work).with_answer(allowance.kept());
    let ticket = state.scheduler.submit_admitted(admission, job, terms)?;
    let done = ticket.wait().await?;
    let inference = access::Inference {
        device: state
            .scheduler
            .device_name(done.device)
            .unwrap_or("?")
            .to_string(),
        queued: done.queued,
        compute: done.compute,
        stages: StageTimings::default(),
        decoded_at,
        started: done.started,
        // Set again by the caller once it has encoded the answer.
        encoded_at: Instant::now(),
    };
    Ok(Served {
        output: done.output,
        inference,
        answer: allowance,
    })
}

/// The refusals that need no body, then the body, then the admission: an oversized
/// declared length (413) and overload (an immediate 503; the connection layer drains the
/// unread body so that the client reads the answer) come before a byte is read. No slot
/// is held while the body arrives (a slow or stalled upload cannot starve anyone; its time
/// is bounded by the connection layer, 408); the slot is taken once it is here, before
/// any decoding, so memory stays bounded by the slots. Every protocol's request starts here.
pub(super) async fn admit_and_read(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Admission, Bytes), ApiError> {
    check_declared_length(headers, state.limits.max_body_bytes)?;
    state.scheduler.check_admission()?;
    let bytes = read_body(body, state.limits.max_body_bytes).await?;
    let admission = state.scheduler.admit()?;
    Ok((admission, bytes))
}

/// A declared `Content-Length` over `limit` is a 413 before a byte is read.
fn check_declared_length(headers: &HeaderMap, limit: usize) -> Result<(), ApiError> {
    match super::body::declared_length(headers) {
        Some(n) if n > limit as u64 => Err(ApiError::payload_too_large("the request body", limit)),
        _ => Ok(()),
    }
}

/// Reads at most `limit` bytes; a larger body is a 413, a body that the connection layer
/// cut off for time a 408, one over the memory of bodies in transit a 503.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            if s.is::<http_body_util::LengthLimitError>() {
                return ApiError::payload_too_large("the request body", limit);
            }
            if let Some(b) = s.downcast_ref::<super::body::BodyError>() {
                return (*b).into();
            }
            source = s.source();
        }
        ApiError::bad_request("bad_body", format!("cannot read the request body: {e}"))
    })
}

/// Runs CPU work on the work pool (`AppState::work`), never on the async executor.
pub(super) async fn blocking<T: Send + 'static>(
    pool: &WorkPool,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    pool.run(work).await.map_err(ApiError::internal)?
}

/// Where the request's image is, once the body has been read.
enum Source {
    Decoded((RgbPixels, Duration)),
    /// A JSON `url`: fetched on the executor (it is I/O), then decoded.
    Url(String),
}

pub(super) fn timed_decode(
    encoded: &[u8],
    limits: &DecodeLimits,
    pixels: &dyn HostAlloc,
) -> Result<(RgbPixels, Duration), ApiError> {
    let t = Instant::now();
    let image = decode::decode_into(encoded, limits, pixels)?;
    Ok((image, t.elapsed()))
}

/// What a JSON body names.
enum JsonImage {
    Inline(Vec<u8>),
    Url(String),
}

fn json_image(bytes: &[u8]) -> Result<JsonImage, ApiError> {
    let body: JsonBody = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(
            "malformed_json",
            format!("the body is not the JSON expected ({{\"image\": \"<base64>\"}}): {e}"),
        )
    })?;
    match (body.image, body.url) {
        (Some(b64), None) => base64::engine::general_purpose::STANDARD
            .decode(base64_payload(&b64).as_ref())
            .map(JsonImage::Inline)
            .map_err(|e| {
                ApiError::bad_request(
                    "invalid_base64",
                    format!("`image` is not valid base64: {e}"),
                )
            }),
        (None, Some(url)) => Ok(JsonImage::Url(url)),
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "malformed_json",
            "give either `image` or `url`, not both",
        )),
        (None, None) => Err(ApiError::bad_request(
            "malformed_json",
            "the JSON body needs `image` (base64) or `url`",
        )),
    }
}

/// The base64 text of `image`, as clients send it: possibly a `data:` URL, possibly
/// wrapped at 76 columns (the `base64` tool, Python's `encodebytes`). Copied only when
/// there is white space to drop.
pub(super) fn base64_payload(text: &str) -> Cow<'_, [u8]> {
    let text = match text.trim_start().strip_prefix("data:") {
        Some(rest) => rest.split_once(',').map_or(rest, |(_, data)| data),
        None => text,
    };
    if text.bytes().any(|b| b.is_ascii_whitespace()) {
        Cow::Owned(text.bytes().filter(|b| !b.is_ascii_whitespace()).collect())
    } else {
        Cow::Borrowed(text.as_bytes())
    }
}

/// `Server-Timing: queue;dur=1.2, decode;dur=3.4, ...` (milliseconds).
pub(super) fn server_timing(queued: std::time::Duration, timings: &StageTimings) -> String {
    std::iter::once(("queue", queued))
        .chain(timings.stages())
        .map(|(name, d)| format!("{name};dur={:.3}", d.as_secs_f64() * 1e3))
        .collect::<Vec<_>>()
        .join(", ")
}
