//! The Open Inference Protocol (KServe v2) over REST, on the SageMaker routes' port:
//! health, server and model metadata, Triton's model configuration, and `infer` with the
//! image as a `BYTES` tensor (base64 in JSON, or raw with the binary-data extension) or a
//! raw `UINT8 [H, W, 3]` tensor. `infer` runs on `/invocations`' request path
//! (`invocations::run_image`): one admission, deadline, body limit, response limit and
//! set of metrics for both. Errors are `{"error": ...}` with the protocol's statuses.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::answer_time::AnswerKind;
use super::error::ApiError;
use super::invocations::{
    admit_and_read, base64_payload, blocking, refuse_unreachable_before_decoding, run_image,
    timed_decode,
};
use super::urgency;
use super::AppState;
use crate::codec::decode::{self, DecodeLimits};
use crate::codec::ImageFormat;
use crate::matte::{MattePlanes, MissingPlane, Planes};
use crate::pixels::{HostAlloc, RgbPixels};

/// The one version this server has of its model.
pub const MODEL_VERSION: &str = "1";
/// The encoded image (JPEG, PNG, ...): `BYTES [1]`.
pub const INPUT_ENCODED: &str = "image";
/// The decoded image, row-major RGB: `UINT8 [H, W, 3]`.
pub const INPUT_RGB: &str = "image_rgb";
/// The binary-data extension's header: how much of the body is the JSON header.
const HEADER_LENGTH: &str = "inference-header-content-length";

/// The model's outputs, in the order of its metadata and of an answer's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::http) enum OutputTensor {
    /// `UINT8 [H, W]`: the alpha matte.
    Alpha,
    /// `UINT8 [H, W]`: 0, 128, 255.
    Trimap,
    /// `BYTES [1]`: the RGBA cut-out, encoded (PNG, or WebP with `"format": "webp"`).
    Cutout,
}

impl OutputTensor {
    pub const ALL: [Self; 3] = [Self::Alpha, Self::Trimap, Self::Cutout];

    pub fn name(self) -> &'static str {
        match self {
            Self::Alpha => "alpha",
            Self::Trimap => "trimap",
            Self::Cutout => "cutout",
        }
    }

    pub fn parse(name: &str) -> Result<Self, ApiError> {
        Self::ALL
            .into_iter()
            .find(|o| o.name() == name)
            .ok_or_else(|| {
                ApiError::bad_request(
                    "unknown_output",
                    format!("no output named `{name}`; the outputs are alpha, trimap and cutout"),
                )
            })
    }

    /// The planes a replica makes for these outputs.
    pub fn planes(asked: impl IntoIterator<Item = Self>) -> Planes {
        asked
            .into_iter()
            .fold(Planes::default(), |mut planes, tensor| {
                match tensor {
                    Self::Alpha => planes.alpha = true,
                    Self::Trimap => planes.trimap = true,
                    Self::Cutout => planes.cutout = true,
                }
                planes
            })
    }

    /// The protocol's datatype and shape (-1: any size).
    pub fn datatype_and_shape(self) -> (&'static str, &'static [i64]) {
        match self {
            Self::Alpha | Self::Trimap => ("UINT8", &[-1, -1]),
            Self::Cutout => ("BYTES", &[1]),
        }
    }

    fn metadata(self) -> Value {
        let (datatype, shape) = self.datatype_and_shape();
        json!({"name": self.name(), "datatype": datatype, "shape": shape})
    }
}

/// The model's inputs (either one, not both): name, datatype and shape.
pub(in crate::http) const INPUTS: [(&str, &str, &[i64]); 2] = [
    (INPUT_ENCODED, "BYTES", &[1]),
    (INPUT_RGB, "UINT8", &[-1, -1, 3]),
];

fn inputs_metadata() -> Value {
    INPUTS
        .iter()
        .map(|(name, datatype, shape)| json!({"name": name, "datatype": datatype, "shape": shape}))
        .collect()
}

// ---- health and metadata ----

/// `GET /v2/health/live`: the process answers.
pub async fn live() -> Response {
    Json(json!({"live": true})).into_response()
}

/// `GET /v2/health/ready` and `.../models/{m}/ready`: as `/ping`, the replicas loaded
/// and a device healthy.
pub async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let (status, ready) = readiness(&state);
    (status, Json(json!({"ready": ready}))).into_response()
}

/// 200 and true when the replicas are loaded (as `/ping` counts them), a device is
/// healthy and the server is not draining; else 503 and false.
pub(in crate::http) fn readiness(state: &AppState) -> (StatusCode, bool) {
    let ready = !state.is_draining()
        && state.loaded_enough(&state.scheduler.readiness())
        && state.scheduler.devices().iter().any(|d| d.healthy);
    if ready {
        (StatusCode::OK, true)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, false)
    }
}

/// The model's readiness: the status as the server's, and the body KServe's own servers
/// answer (`{"name", "ready"}`, kserve's `ModelReadyResponse`), not the server's
/// `{"ready"}` alone.
pub async fn model_ready(
    State(state): State<Arc<AppState>>,
    Path(params): Path<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    model_named(&state, &params)?;
    let (status, ready) = readiness(&state);
    Ok((
        status,
        Json(json!({"name": state.model.name, "ready": ready})),
    )
        .into_response())
}

/// `GET /v2`: the server's metadata.
pub async fn server_metadata() -> Json<Value> {
    Json(json!({
        "name": "celer",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["binary_tensor_data", "model_configuration"],
    }))
}

/// `GET /v2/models/{m}[/versions/{v}]`.
pub async fn model_metadata(
    State(state): State<Arc<AppState>>,
    Path(params): Path<Vec<(String, String)>>,
) -> Result<Json<Value>, ApiError> {
    model_named(&state, &params)?;
    Ok(Json(json!({
        "name": state.model.name,
        "versions": [MODEL_VERSION],
        "platform": "celer",
        "inputs": inputs_metadata(),
        "outputs": OutputTensor::ALL.map(OutputTensor::metadata),
    })))
}

/// `GET /v2/models/{m}/config`: Triton's model configuration, which Triton's tools read.
/// No batch dimension (`max_batch_size` 0): images differ in size, and the replicas batch
/// requests themselves when the pipeline allows it (`dynamic_batching`).
pub async fn model_config(
    State(state): State<Arc<AppState>>,
    Path(params): Path<Vec<(String, String)>>,
) -> Result<Json<Value>, ApiError> {
    model_named(&state, &params)?;
    let mut config = json!({
        "name": state.model.name,
        "platform": "celer",
        "backend": "celer",
        "max_batch_size": 0,
        "input": [
            {"name": INPUT_ENCODED, "data_type": "TYPE_STRING", "dims": [1]},
            {"name": INPUT_RGB, "data_type": "TYPE_UINT8", "dims": [-1, -1, 3]},
        ],
        "output": [
            {"name": "alpha", "data_type": "TYPE_UINT8", "dims": [-1, -1]},
            {"name": "trimap", "data_type": "TYPE_UINT8", "dims": [-1, -1]},
            {"name": "cutout", "data_type": "TYPE_STRING", "dims": [1]},
        ],
    });
    if state.model.max_batch > 1 {
        config["dynamic_batching"] = json!({
            "max_queue_delay_microseconds": state.model.max_wait_us,
            "preferred_batch_size": [state.model.max_batch],
        });
    }
    Ok(Json(config))
}

/// The model a route names (`model`, and `version` when given) must be this server's.
pub(in crate::http) fn model_named(
    state: &AppState,
    params: &[(String, String)],
) -> Result<(), ApiError> {
    let not_found = |what: String| ApiError::new(StatusCode::NOT_FOUND, "unknown_model", what);
    for (key, value) in params {
        match key.as_str() {
            "model" if *value != state.model.name => {
                return Err(not_found(format!(
                    "no model named `{value}`; this server serves `{}`",
                    state.model.name
                )))
            }
            "version" if value != MODEL_VERSION => {
                return Err(not_found(format!(
                    "model `{}` has no version `{value}`; its version is {MODEL_VERSION}",
                    state.model.name
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

// ---- infer ----

#[derive(Debug, Default, Deserialize)]
struct Parameters {
    binary_data_size: Option<usize>,
    binary_data: Option<bool>,
    binary_data_output: Option<bool>,
    format: Option<String>,
    /// The request's priority level (1 runs first), as Triton takes it.
    priority: Option<u64>,
    /// The request's deadline in microseconds from its arrival, as Triton takes it.
    timeout: Option<u64>,
    /// The same in milliseconds, as SageMaker's `deadline-ms=`.
    deadline_ms: Option<u64>,
}

impl Parameters {
    /// The priority and deadline a request's parameters ask for; `timeout` and
    /// `deadline_ms` together are the sooner.
    fn urgency(&self) -> urgency::Asked {
        let timeout = self.timeout.map(Duration::from_micros);
        let deadline = self.deadline_ms.map(Duration::from_millis);
        urgency::Asked {
            priority: self.priority,
            within: urgency::sooner(timeout, deadline),
        }
    }
}

#[derive(Debug, Deserialize)]
struct InferRequest {
    id: Option<String>,
    inputs: Vec<RequestInput>,
    #[serde(default)]
    outputs: Vec<RequestOutput>,
    #[serde(default)]
    parameters: Parameters,
}

#[derive(Debug, Deserialize)]
struct RequestInput {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Parameters,
    data: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct RequestOutput {
    name: String,
    #[serde(default)]
    parameters: Parameters,
}

/// An output asked for, and how it is sent.
#[derive(Debug, Clone, Copy)]
struct Asked {
    tensor: OutputTensor,
    binary: bool,
    format: ImageFormat,
}

/// What an `infer` body holds once parsed: the image and what to answer.
struct Parsed {
    image: RgbPixels,
    decode_time: std::time::Duration,
    id: Option<String>,
    asked: Vec<Asked>,
    urgency: urgency::Asked,
}

/// `POST /v2/models/{m}[/versions/{v}]/infer`.
pub async fn infer(
    State(state): State<Arc<AppState>>,
    Path(params): Path<Vec<(String, String)>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    model_named(&state, &params)?;
    let json_length = header_length(&headers)?;
    // As /invocations: refused before the body is read when overloaded (a fast 503),
    // admitted once the body is here.
    let (admission, bytes) = admit_and_read(&state, &headers, body).await?;
    let limits = state.limits.decode;
    let pixels = state.pixels.clone();
    let server = state.limits.deadline;
    let checking = state.clone();
    let parsed = blocking(&state.work, move || {
        // Refused for its deadline from the image's header, before its decode, as an
        // image body to /invocations is.
        let before_decode = |encoded: &[u8], planes: Planes, asked: urgency::Asked| {
            let terms = asked.terms(arrived, server)?;
            refuse_unreachable_before_decoding(
                &checking,
                encoded,
                planes,
                &terms,
                AnswerKind::V2Rest,
            )
        };
        parse_infer(bytes, json_length, &limits, pixels.as_ref(), &before_decode)
    })
    .await?;
    let planes = OutputTensor::planes(parsed.asked.iter().map(|a| a.tensor));
    let terms = parsed.urgency.terms(arrived, server)?;
    let served = run_image(
        &state,
        admission,
        parsed.image,
        parsed.decode_time,
        planes,
        terms,
        AnswerKind::V2Rest,
    )
    .await?;
    let model = state.model.name.clone();
    let (id, asked) = (parsed.id, parsed.asked);
    let (answer, inference, dimensions) = served
        .encode(&state.work, move |planes| {
            answer(&model, id, &asked, planes)
        })
        .await?;
    if let Some(limit) = state
        .hosting
        .max_response_bytes
        .filter(|&limit| answer.body.len() > limit)
    {
        let (w, h) = dimensions;
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "response_too_large",
            format!(
                "the answer for a {w}x{h} image is {} bytes, over this server's response limit \
                 of {limit} bytes ({} hosting); ask for fewer outputs (`alpha` alone is \
                 {w}x{h} bytes), binary outputs, the cut-out with \"format\": \"webp\", or a \
                 smaller image; or, where no SageMaker cap applies (KServe), start celer with \
                 --max-response-bytes 0",
                answer.body.len(),
                state.hosting.mode
            ),
        ));
    }
    let mut response = (StatusCode::OK, answer.body).into_response();
    response.extensions_mut().insert(inference);
    let h = response.headers_mut();
    match answer.json_length {
        Some(n) => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(HEADER_LENGTH, HeaderValue::from(n));
        }
        None => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
    }
    Ok(response)
}

fn header_length(headers: &HeaderMap) -> Result<Option<usize>, ApiError> {
    headers
        .get(HEADER_LENGTH)
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "bad_header",
                        "Inference-Header-Content-Length is not a byte count",
                    )
                })
        })
        .transpose()
}

pub(in crate::http) fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("bad_inference_request", message)
}

/// What a request's parse asks before an encoded image is decoded: whether to go on, from
/// the image's bytes (its header says its size), the planes its outputs need and the
/// client's priority and deadline.
type BeforeDecode<'a> = &'a dyn Fn(&[u8], Planes, urgency::Asked) -> Result<(), ApiError>;

/// The JSON header and the binary tensors after it (the binary-data extension), the
/// image decoded (or copied from its raw tensor) within `limits`, once `before_decode`
/// has let an encoded one through.
fn parse_infer(
    body: Bytes,
    json_length: Option<usize>,
    limits: &DecodeLimits,
    pixels: &dyn HostAlloc,
    before_decode: BeforeDecode<'_>,
) -> Result<Parsed, ApiError> {
    let json_length = json_length.unwrap_or(body.len());
    if json_length > body.len() {
        return Err(bad(format!(
            "Inference-Header-Content-Length is {json_length}, over the body's {} bytes",
            body.len()
        )));
    }
    let request: InferRequest = serde_json::from_slice(&body[..json_length]).map_err(|e| {
        ApiError::bad_request(
            "malformed_json",
            format!("the inference request is not the protocol's JSON: {e}"),
        )
    })?;
    let mut binary = body.slice(json_length..);
    let [input] = &request.inputs[..] else {
        return Err(bad(format!(
            "give one input, `{INPUT_ENCODED}` (BYTES) or `{INPUT_RGB}` (UINT8 [H, W, 3]); got {}",
            request.inputs.len()
        )));
    };
    let raw = match input.parameters.binary_data_size {
        Some(n) if n > binary.len() => {
            return Err(bad(format!(
                "input `{}` declares {n} binary bytes; {} follow the JSON",
                input.name,
                binary.len()
            )))
        }
        Some(n) => Some(binary.split_to(n)),
        None => None,
    };
    let binary_default = request.parameters.binary_data_output.unwrap_or(false);
    let asked: Vec<Asked> = if request.outputs.is_empty() {
        OutputTensor::ALL
            .into_iter()
            .map(|tensor| Asked {
                tensor,
                binary: binary_default,
                format: ImageFormat::Png,
            })
            .collect()
    } else {
        request
            .outputs
            .iter()
            .map(|o| {
                let format = match o.parameters.format.as_deref() {
                    None | Some("png") => ImageFormat::Png,
                    Some("webp") => ImageFormat::Webp,
                    Some(other) => {
                        return Err(bad(format!(
                            "output `{}`: format {other}: expected png or webp",
                            o.name
                        )))
                    }
                };
                Ok(Asked {
                    tensor: OutputTensor::parse(&o.name)?,
                    binary: o.parameters.binary_data.unwrap_or(binary_default),
                    format,
                })
            })
            .collect::<Result<_, _>>()?
    };
    let urgency = request.parameters.urgency();
    let (image, decode_time) = match (input.name.as_str(), input.datatype.as_str()) {
        (INPUT_ENCODED, "BYTES") => {
            let encoded = encoded_image(input, raw)?;
            before_decode(
                &encoded,
                OutputTensor::planes(asked.iter().map(|a| a.tensor)),
                urgency,
            )?;
            timed_decode(&encoded, limits, pixels)?
        }
        (INPUT_RGB, "UINT8") => {
            let t = Instant::now();
            (rgb_image(input, raw, limits, pixels)?, t.elapsed())
        }
        (name, datatype) => {
            return Err(bad(format!(
                "input `{name}` of {datatype}: this model takes `{INPUT_ENCODED}` as BYTES or `{INPUT_RGB}` as UINT8"
            )))
        }
    };
    Ok(Parsed {
        image,
        decode_time,
        id: request.id,
        asked,
        urgency,
    })
}

/// The number of elements a shape holds; every dimension must be known.
fn elements(input: &RequestInput) -> Result<u64, ApiError> {
    input.shape.iter().try_fold(1u64, |n, &d| {
        u64::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| {
                bad(format!(
                    "input `{}`: bad shape {:?}",
                    input.name, input.shape
                ))
            })
    })
}

/// The encoded image of a `BYTES [1]` input: in binary, one element (a 4-byte
/// little-endian length, then the bytes); in JSON, one string of base64 (or a `data:`
/// URL, or `{"b64": ...}`): an image is not UTF-8 text.
fn encoded_image(input: &RequestInput, raw: Option<Bytes>) -> Result<Vec<u8>, ApiError> {
    if elements(input)? != 1 {
        return Err(bad(format!(
            "input `{INPUT_ENCODED}` holds one image: shape [1], got {:?}",
            input.shape
        )));
    }
    if let Some(raw) = raw {
        return bytes_element(&raw).map(<[u8]>::to_vec);
    }
    let mut data = input.data.as_ref().ok_or_else(|| {
        bad(format!(
            "input `{INPUT_ENCODED}` has neither `data` nor binary_data_size"
        ))
    })?;
    while let Value::Array(items) = data {
        match &items[..] {
            [one] => data = one,
            _ => return Err(bad(format!("input `{INPUT_ENCODED}` holds one image"))),
        }
    }
    let text = match data {
        Value::String(s) => s.as_str(),
        Value::Object(o) => o
            .get("b64")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("a JSON BYTES element is a base64 string, or {\"b64\": \"...\"}"))?,
        _ => return Err(bad("a JSON BYTES element is a base64 string")),
    };
    base64::engine::general_purpose::STANDARD
        .decode(base64_payload(text).as_ref())
        .map_err(|e| {
            ApiError::bad_request(
                "invalid_base64",
                format!("input `{INPUT_ENCODED}` is not base64 (an image in JSON is sent in base64): {e}"),
            )
        })
}

/// The one element of a raw `BYTES [1]` tensor: a 4-byte little-endian length, then that
/// many bytes (the layout of the binary-data extension and of gRPC's raw contents).
pub(in crate::http) fn bytes_element(raw: &[u8]) -> Result<&[u8], ApiError> {
    let (length, rest) = raw
        .split_first_chunk::<4>()
        .ok_or_else(|| bad("a binary BYTES element starts with its 4-byte length"))?;
    let length = u32::from_le_bytes(*length) as usize;
    if length != rest.len() {
        return Err(bad(format!(
            "the BYTES element says {length} bytes; {} follow",
            rest.len()
        )));
    }
    Ok(rest)
}

/// The width, height and byte count of a `UINT8 [H, W, 3]` input's shape (a leading batch
/// dimension of 1 allowed), checked against the limits before a byte is read.
pub(in crate::http) fn rgb_shape(
    shape: &[i64],
    limits: &DecodeLimits,
) -> Result<(u32, u32, usize), ApiError> {
    let (h, w) = match shape[..] {
        [h, w, 3] | [1, h, w, 3] => (h, w),
        _ => {
            return Err(bad(format!(
                "input `{INPUT_RGB}` is [H, W, 3]; got {shape:?}"
            )))
        }
    };
    let side =
        |d: i64| u32::try_from(d).map_err(|_| bad(format!("input `{INPUT_RGB}`: shape {shape:?}")));
    let (height, width) = (side(h)?, side(w)?);
    decode::check_size(width, height, limits)?;
    Ok((width, height, width as usize * height as usize * 3))
}

/// `given`, the bytes of a `UINT8 [H, W, 3]` input, as the image (copied once, into bytes
/// from `pixels`, as a decoder would write them).
pub(in crate::http) fn rgb_pixels(
    shape: &[i64],
    (width, height, expected): (u32, u32, usize),
    given: &[u8],
    pixels: &dyn HostAlloc,
) -> Result<RgbPixels, ApiError> {
    if given.len() != expected {
        return Err(bad(format!(
            "input `{INPUT_RGB}` of shape {shape:?} needs {expected} bytes; got {}",
            given.len()
        )));
    }
    let mut bytes = pixels.alloc(expected);
    bytes.copy_from_slice(given);
    RgbPixels::from_raw(width, height, bytes)
        .ok_or_else(|| bad(format!("input `{INPUT_RGB}`: shape {shape:?}")))
}

/// The image of a `UINT8 [H, W, 3]` input, its size checked against the limits before a
/// pixel is copied.
fn rgb_image(
    input: &RequestInput,
    raw: Option<Bytes>,
    limits: &DecodeLimits,
    pixels: &dyn HostAlloc,
) -> Result<RgbPixels, ApiError> {
    let size = rgb_shape(&input.shape, limits)?;
    let expected = size.2;
    let flattened;
    let given: &[u8] = match &raw {
        Some(raw) => raw,
        None => {
            let mut out = Vec::with_capacity(expected);
            flatten_u8(input.data.as_ref().unwrap_or(&Value::Null), &mut out)?;
            flattened = out;
            &flattened
        }
    };
    rgb_pixels(&input.shape, size, given, pixels)
}

/// JSON tensor data, flat or nested, as bytes 0 to 255.
fn flatten_u8(value: &Value, out: &mut Vec<u8>) -> Result<(), ApiError> {
    match value {
        Value::Array(items) => items.iter().try_for_each(|v| flatten_u8(v, out)),
        Value::Number(n) => {
            let byte = n
                .as_u64()
                .and_then(|v| u8::try_from(v).ok())
                .ok_or_else(|| bad(format!("UINT8 data holds {n}")))?;
            out.push(byte);
            Ok(())
        }
        _ => Err(bad("UINT8 data is an array of numbers 0 to 255")),
    }
}

/// A JSON `UINT8` tensor's data, written without building a `Value` per pixel.
struct U8Data<'a>(&'a [u8]);

impl Serialize for U8Data<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum TensorData<'a> {
    Bytes(U8Data<'a>),
    Strings([String; 1]),
}

#[derive(Serialize)]
struct ResponseOutput<'a> {
    name: &'static str,
    datatype: &'static str,
    shape: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<TensorData<'a>>,
}

/// An encoded answer: the JSON, then (with the binary extension) the binary tensors.
struct Answer {
    body: Vec<u8>,
    /// The JSON's length, when binary tensors follow it.
    json_length: Option<usize>,
}

fn answer(
    model: &str,
    id: Option<String>,
    asked: &[Asked],
    planes: &MattePlanes,
) -> Result<Answer, ApiError> {
    let (w, h) = planes.dimensions();
    let missing = |e: MissingPlane| ApiError::internal(e);
    let mut binary: Vec<Vec<u8>> = Vec::new();
    let mut outputs = Vec::new();
    // Each tensor's bytes: the planes borrowed, the cut-out encoded here.
    let mut kept: Vec<(Asked, Cow<'_, [u8]>)> = Vec::with_capacity(asked.len());
    for a in asked {
        let bytes = match a.tensor {
            OutputTensor::Alpha => Cow::Borrowed(&planes.alpha().map_err(missing)?.as_raw()[..]),
            OutputTensor::Trimap => Cow::Borrowed(&planes.trimap().map_err(missing)?.as_raw()[..]),
            OutputTensor::Cutout => {
                let rgba = planes.cutout().map_err(missing)?;
                Cow::Owned(
                    a.format
                        .encode(rgba.as_raw(), w, h, image::ExtendedColorType::Rgba8)
                        .map_err(ApiError::internal)?,
                )
            }
        };
        kept.push((*a, bytes));
    }
    for (a, bytes) in &kept {
        let (datatype, shape) = match a.tensor {
            OutputTensor::Alpha | OutputTensor::Trimap => ("UINT8", vec![h, w]),
            OutputTensor::Cutout => ("BYTES", vec![1]),
        };
        let (parameters, data) = if a.binary {
            let blob = if a.tensor == OutputTensor::Cutout {
                let mut element = (bytes.len() as u32).to_le_bytes().to_vec();
                element.extend_from_slice(bytes);
                element
            } else {
                bytes.to_vec()
            };
            let parameters = json!({"binary_data_size": blob.len()});
            binary.push(blob);
            (Some(parameters), None)
        } else if a.tensor == OutputTensor::Cutout {
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            (None, Some(TensorData::Strings([b64])))
        } else {
            (None, Some(TensorData::Bytes(U8Data(bytes))))
        };
        outputs.push(ResponseOutput {
            name: a.tensor.name(),
            datatype,
            shape,
            parameters,
            data,
        });
    }
    let mut head = json!({"model_name": model, "model_version": MODEL_VERSION});
    if let Some(id) = id {
        head["id"] = Value::String(id);
    }
    #[derive(Serialize)]
    struct Head<'a> {
        #[serde(flatten)]
        head: Value,
        outputs: Vec<ResponseOutput<'a>>,
    }
    let mut body = serde_json::to_vec(&Head { head, outputs }).map_err(ApiError::internal)?;
    if binary.is_empty() {
        return Ok(Answer {
            body,
            json_length: None,
        });
    }
    let json_length = body.len();
    for blob in binary {
        body.extend_from_slice(&blob);
    }
    Ok(Answer {
        body,
        json_length: Some(json_length),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DecodeLimits {
        DecodeLimits::default()
    }

    /// An `infer` body parsed under the default limits, its pixels on the heap.
    fn parse(body: Bytes, json_length: Option<usize>) -> Result<Parsed, ApiError> {
        parse_infer(
            body,
            json_length,
            &limits(),
            &crate::pixels::Heap,
            &|_, _, _| Ok(()),
        )
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        image::RgbImage::from_pixel(w, h, image::Rgb([9, 8, 7]))
            .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    }

    #[test]
    fn bytes_input_in_json_base64_and_binary() {
        let image = png(16, 12);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&image);
        let body = json!({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [b64]}]});
        let parsed = parse(Bytes::from(body.to_string()), None).unwrap();
        assert_eq!(parsed.image.dimensions(), (16, 12));
        assert_eq!(parsed.asked.len(), 3);

        let mut element = (image.len() as u32).to_le_bytes().to_vec();
        element.extend_from_slice(&image);
        let head = json!({
            "id": "7",
            "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                        "parameters": {"binary_data_size": element.len()}}],
            "outputs": [{"name": "alpha", "parameters": {"binary_data": true}}],
        })
        .to_string();
        let mut body = head.clone().into_bytes();
        body.extend_from_slice(&element);
        let parsed = parse(Bytes::from(body), Some(head.len())).unwrap();
        assert_eq!(parsed.image.dimensions(), (16, 12));
        assert_eq!(parsed.id.as_deref(), Some("7"));
        assert_eq!(parsed.asked.len(), 1);
        assert!(parsed.asked[0].binary);
    }

    #[test]
    fn uint8_input_checked_against_its_shape_and_the_limits() {
        let pixels: Vec<u8> = (0..10 * 8 * 3).map(|v| v as u8).collect();
        let head =
            json!({"inputs": [{"name": "image_rgb", "shape": [8, 10, 3], "datatype": "UINT8",
                                      "parameters": {"binary_data_size": pixels.len()}}]})
            .to_string();
        let mut body = head.clone().into_bytes();
        body.extend_from_slice(&pixels);
        let parsed = parse(Bytes::from(body), Some(head.len())).unwrap();
        assert_eq!(parsed.image.dimensions(), (10, 8));
        assert_eq!(&parsed.image.as_raw()[..], &pixels[..]);

        let nested = json!({"inputs": [{"name": "image_rgb", "shape": [8, 10, 3], "datatype": "UINT8",
                                        "data": vec![vec![vec![1, 2, 3]; 10]; 8]}]});
        let parsed = parse(Bytes::from(nested.to_string()), None).unwrap();
        assert_eq!(&parsed.image.as_raw()[..3], &[1, 2, 3]);

        // Too large for the limits: refused from the shape alone.
        let huge = json!({"inputs": [{"name": "image_rgb", "shape": [100000, 100000, 3], "datatype": "UINT8", "data": []}]});
        let e = parse(Bytes::from(huge.to_string()), None).err().unwrap();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        for bad_body in [
            json!({"inputs": [{"name": "image_rgb", "shape": [8, 10, 3], "datatype": "UINT8", "data": [1, 2]}]}),
            json!({"inputs": [{"name": "image_rgb", "shape": [8, 10, 3], "datatype": "UINT8", "data": [300]}]}),
            json!({"inputs": [{"name": "image", "shape": [1], "datatype": "UINT8", "data": [1]}]}),
            json!({"inputs": []}),
            json!({"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}),
            json!({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["%%%"]}]}),
            json!({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [""]}],
                   "outputs": [{"name": "mask"}]}),
        ] {
            let e = parse(Bytes::from(bad_body.to_string()), None)
                .err()
                .unwrap_or_else(|| panic!("accepted {bad_body}"));
            assert!(e.status.is_client_error(), "{bad_body}: {}", e.status);
        }
        let e = parse(Bytes::from_static(b"{}"), Some(10)).err().unwrap();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn answers_json_and_binary() {
        let matte = crate::matte::Matte::from_images(
            image::GrayImage::from_raw(2, 1, vec![0, 255]).unwrap(),
            image::GrayImage::from_raw(2, 1, vec![0, 128]).unwrap(),
        );
        let cutout = image::RgbaImage::from_raw(2, 1, vec![0, 0, 0, 0, 1, 2, 3, 255]).unwrap();
        let planes = MattePlanes::from_matte(matte, Some(cutout.clone()));
        let all = |binary| {
            OutputTensor::ALL.map(|tensor| Asked {
                tensor,
                binary,
                format: ImageFormat::Png,
            })
        };
        let a = answer("m", Some("x".into()), &all(false), &planes).unwrap();
        assert_eq!(a.json_length, None);
        let v: Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(v["id"], "x");
        assert_eq!(v["outputs"][0]["data"], json!([0, 255]));
        assert_eq!(v["outputs"][1]["shape"], json!([1, 2]));
        let png = base64::engine::general_purpose::STANDARD
            .decode(v["outputs"][2]["data"][0].as_str().unwrap())
            .unwrap();
        assert_eq!(
            image::load_from_memory(&png).unwrap().into_rgba8().as_raw(),
            cutout.as_raw()
        );

        let a = answer("m", None, &all(true), &planes).unwrap();
        let n = a.json_length.unwrap();
        let v: Value = serde_json::from_slice(&a.body[..n]).unwrap();
        assert_eq!(v["outputs"][0]["parameters"]["binary_data_size"], 2);
        assert_eq!(&a.body[n..n + 4], &[0, 255, 0, 128]);
        let element = &a.body[n + 4..];
        assert_eq!(
            u32::from_le_bytes(element[..4].try_into().unwrap()) as usize,
            element.len() - 4
        );
    }
}
