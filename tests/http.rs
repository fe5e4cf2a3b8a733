//! The HTTP front end against the SageMaker container contract: `GET /ping` and
//! `POST /invocations`, in-process (`tower::ServiceExt::oneshot` on the router) for the
//! request matrix, over real sockets for what only a socket shows (chunked bodies,
//! concurrency and overload, URL fetching), and the `celer` binary itself once, from
//! start to SIGTERM.
//!
//! Most tests run the `prob-guided` fixture (a 64x64 model whose probability is the
//! brightness, guided-filter matting): fast, and its alpha is known, a bright rectangle
//! on a dark background is cut out exactly. The overload, EXIF and binary tests run
//! U2NetP (`make models`).

// `unsafe` here: a counting global allocator; each block says why it is sound.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::Router;
use base64::Engine;
use bytes::Bytes;
use celer::codec::decode::DecodeLimits;
use celer::config::RequestLimits;
use celer::http::{routes, AppState, FrontEnd, UrlFetcher};
use common::{
    app_state, bright_rectangle, fetched, fixture_dir, jpeg_bytes, model_dir, png_bytes,
    StateOptions,
};
use http_body_util::BodyExt;
use image::{DynamicImage, GrayImage};
use tower::ServiceExt;

const CUSTOM_ATTRIBUTES: &str = "x-amzn-sagemaker-custom-attributes";
/// The generated test image: the fixture's 64x64 model sees it resized.
const W: u32 = 64;
const H: u32 = 48;

// ---- the largest single allocation, to show that a decompression bomb allocates nothing ----

struct TrackingAllocator;

static LARGEST_ALLOCATION: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the wrapper only
// records the requested sizes.
unsafe impl GlobalAlloc for TrackingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged; the caller upholds GlobalAlloc's contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged; the caller upholds GlobalAlloc's contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded unchanged; the caller upholds GlobalAlloc's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; the caller upholds GlobalAlloc's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: TrackingAllocator = TrackingAllocator;

// ---- states and requests ----

/// The fixture pipeline with the default limits, shared by the tests that need nothing
/// else (the state holds no runtime: each test's runtime drives it).
fn fixture_app() -> Router {
    static STATE: OnceLock<Arc<AppState>> = OnceLock::new();
    routes(
        STATE
            .get_or_init(|| {
                // Room in the queue for every test at once.
                Arc::new(app_state(
                    &fixture_dir("prob-guided"),
                    StateOptions {
                        queue_capacity: 64,
                        ..StateOptions::default()
                    },
                ))
            })
            .clone(),
    )
}

fn fixture_app_with(options: StateOptions) -> Router {
    routes(Arc::new(app_state(&fixture_dir("prob-guided"), options)))
}

fn limits(max_body_bytes: usize) -> RequestLimits {
    RequestLimits {
        max_body_bytes,
        decode: DecodeLimits::default(),
        deadline: Duration::from_secs(60),
    }
}

fn test_png() -> Vec<u8> {
    png_bytes(&bright_rectangle(W, H))
}

/// `POST /invocations` with `content_type` (none if `None`), `headers` and `body`.
fn post(content_type: Option<&str>, headers: &[(&str, &str)], body: Vec<u8>) -> Request<Body> {
    let mut builder = Request::post("/invocations");
    if let Some(ct) = content_type {
        builder = builder.header(header::CONTENT_TYPE, ct);
    }
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    builder.body(Body::from(body)).unwrap()
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn content_type(&self) -> &str {
        self.headers
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A 200 PNG of the expected size, decoded.
    fn png(&self, width: u32, height: u32) -> DynamicImage {
        assert_eq!(
            self.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(self.content_type(), "image/png");
        let image = image::load_from_memory_with_format(&self.body, image::ImageFormat::Png)
            .expect("the answer is a PNG");
        assert_eq!((image.width(), image.height()), (width, height));
        image
    }

    /// A refusal: `status`, a JSON body with `code` and a non-empty `error`.
    fn refused(&self, status: StatusCode, code: &str) {
        let json = self.json();
        assert_eq!(self.status, status, "{json}");
        assert_eq!(self.content_type(), "application/json");
        assert_eq!(json["code"], code, "{json}");
        assert!(
            json["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{json}"
        );
    }
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

async fn assert_ping_ok(app: &Router) {
    let answer = send(app, Request::get("/ping").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.content_type(), "application/json");
    assert_eq!(answer.json()["status"], "ok");
}

/// The fixture's alpha for `bright_rectangle(W, H)`: 255 well inside the rectangle, 0
/// well away from it (the guided filter's radius is 4 pixels).
fn assert_rectangle_cut_out(alpha: &GrayImage) {
    let (w, h) = alpha.dimensions();
    let margin = 6;
    for (x, y, a) in alpha.enumerate_pixels() {
        let inside = (w / 4 + margin..3 * w / 4 - margin).contains(&x)
            && (h / 4 + margin..3 * h / 4 - margin).contains(&y);
        let outside = x + margin < w / 4
            || x >= 3 * w / 4 + margin
            || y + margin < h / 4
            || y >= 3 * h / 4 + margin;
        if inside {
            assert_eq!(a[0], 255, "alpha at ({x}, {y}), inside the rectangle");
        } else if outside {
            assert_eq!(a[0], 0, "alpha at ({x}, {y}), in the background");
        }
    }
}

// ---- crafted files ----

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn adler32(bytes: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in bytes {
        a = (a + u32::from(x)) % 65521;
        b = (b + a) % 65521;
    }
    (b << 16) | a
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// An 8-bit grayscale PNG whose header says `width` x `height`, with `rows` (filter
/// byte + pixels per row) stored uncompressed: a bomb needs no more than the header.
fn crafted_gray_png(width: u32, height: u32, rows: &[u8]) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 0, 0, 0, 0]); // depth 8, gray, deflate, filter 0, no interlace
    png_chunk(&mut out, b"IHDR", &ihdr);
    // zlib: header, one final stored block, Adler-32.
    let mut zlib = vec![0x78, 0x01, 0x01];
    let len = rows.len() as u16;
    zlib.extend_from_slice(&len.to_le_bytes());
    zlib.extend_from_slice(&(!len).to_le_bytes());
    zlib.extend_from_slice(rows);
    zlib.extend_from_slice(&adler32(rows).to_be_bytes());
    png_chunk(&mut out, b"IDAT", &zlib);
    png_chunk(&mut out, b"IEND", &[]);
    out
}

/// Deterministic noise that starts with no image format's magic bytes.
fn noise(len: usize) -> Vec<u8> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut out: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    out[..4].copy_from_slice(b"\x13\x37\x13\x37");
    out
}

// ---- /ping ----

#[tokio::test]
async fn ping_answers_200_with_json_once_loaded() {
    assert_ping_ok(&fixture_app()).await;
}

// ---- happy paths ----

#[tokio::test]
async fn every_accepted_content_type_gives_an_rgba_cutout_of_the_source_size() {
    let app = fixture_app();
    let png = test_png();
    let jpeg = jpeg_bytes(&bright_rectangle(W, H), 95);
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    let json = serde_json::to_vec(&serde_json::json!({ "image": b64 })).unwrap();
    // As `base64` (the tool) writes it, wrapped at 76 columns, inside a data: URL.
    let wrapped: Vec<String> = b64
        .as_bytes()
        .chunks(76)
        .map(|c| String::from_utf8(c.to_vec()).unwrap())
        .collect();
    let data_url = serde_json::to_vec(&serde_json::json!({
        "image": format!("data:image/png;base64,{}\n", wrapped.join("\n")),
    }))
    .unwrap();
    for (content_type, body) in [
        ("application/json", data_url),
        ("image/png", png.clone()),
        ("image/jpeg", jpeg.clone()),
        ("application/x-image", png.clone()),
        ("application/octet-stream", jpeg),
        ("Image/PNG; charset=binary", png),
        ("application/json", json),
    ] {
        let answer = send(&app, post(Some(content_type), &[], body)).await;
        let image = answer.png(W, H);
        assert_eq!(
            image.color(),
            image::ColorType::Rgba8,
            "Content-Type {content_type}"
        );
        let rgba = image.into_rgba8();
        let alpha = GrayImage::from_fn(W, H, |x, y| image::Luma([rgba.get_pixel(x, y)[3]]));
        assert_rectangle_cut_out(&alpha);
        // The cut-out keeps the source colour where it is opaque.
        let centre = rgba.get_pixel(W / 2, H / 2);
        assert!(
            centre[0] > 200 && centre[3] == 255,
            "Content-Type {content_type}: {centre:?}"
        );
    }
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn accept_json_gives_every_png_and_the_stage_timings() {
    let answer = send(
        &fixture_app(),
        post(
            Some("image/png"),
            &[("accept", "application/json")],
            test_png(),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.content_type(), "application/json");
    let json = answer.json();
    assert_eq!(json["width"], W);
    assert_eq!(json["height"], H);
    let png = |key: &str| {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(json[key].as_str().unwrap_or_else(|| panic!("no {key}")))
            .unwrap_or_else(|e| panic!("{key} is not base64: {e}"));
        let image = image::load_from_memory_with_format(&bytes, image::ImageFormat::Png)
            .unwrap_or_else(|e| panic!("{key} is not a PNG: {e}"));
        assert_eq!((image.width(), image.height()), (W, H), "{key}");
        image
    };
    assert_eq!(png("cutout_png").color(), image::ColorType::Rgba8);
    let alpha = png("alpha_png");
    assert_eq!(alpha.color(), image::ColorType::L8);
    assert_rectangle_cut_out(&alpha.into_luma8());
    assert_eq!(png("trimap_png").color(), image::ColorType::L8);
    let timings = json["timings_ms"].as_object().expect("timings_ms");
    for key in [
        "decode",
        "preprocess",
        "model",
        "trimap",
        "matting",
        "composite",
        "encode",
    ] {
        let ms = timings[key]
            .as_f64()
            .unwrap_or_else(|| panic!("timings_ms.{key}"));
        assert!(ms >= 0.0, "timings_ms.{key} = {ms}");
    }
    assert!(timings["model"].as_f64().unwrap() > 0.0);
}

#[tokio::test]
async fn output_alpha_gives_a_grayscale_png() {
    let app = fixture_app();
    for attributes in ["output=alpha", "trace=on; Output = alpha"] {
        let answer = send(
            &app,
            post(
                Some("image/png"),
                &[(CUSTOM_ATTRIBUTES, attributes), ("accept", "image/png")],
                test_png(),
            ),
        )
        .await;
        let alpha = answer.png(W, H);
        assert_eq!(alpha.color(), image::ColorType::L8, "{attributes}");
        assert_rectangle_cut_out(&alpha.into_luma8());
    }
}

#[tokio::test]
async fn output_trimap_has_only_the_three_trimap_values() {
    let answer = send(
        &fixture_app(),
        post(
            Some("image/png"),
            &[(CUSTOM_ATTRIBUTES, "output=trimap")],
            test_png(),
        ),
    )
    .await;
    let trimap = answer.png(W, H);
    assert_eq!(trimap.color(), image::ColorType::L8);
    let trimap = trimap.into_luma8();
    let mut seen = [false; 256];
    for p in trimap.pixels() {
        seen[usize::from(p[0])] = true;
    }
    let values: Vec<usize> = (0..256).filter(|&v| seen[v]).collect();
    assert_eq!(values, [0, 128, 255], "the trimap's values");
    assert_eq!(trimap.get_pixel(W / 2, H / 2)[0], 255);
    assert_eq!(trimap.get_pixel(0, 0)[0], 0);
}

#[tokio::test]
async fn server_timing_header_only_when_enabled() {
    let on = fixture_app_with(StateOptions {
        server_timing: true,
        ..StateOptions::default()
    });
    let answer = send(&on, post(Some("image/png"), &[], test_png())).await;
    answer.png(W, H);
    let timing = answer
        .headers
        .get("server-timing")
        .expect("a Server-Timing header")
        .to_str()
        .unwrap()
        .to_string();
    for stage in [
        "queue",
        "decode",
        "preprocess",
        "model",
        "trimap",
        "matting",
        "composite",
        "encode",
    ] {
        assert!(
            timing.contains(&format!("{stage};dur=")),
            "Server-Timing: {timing}"
        );
    }

    let answer = send(&fixture_app(), post(Some("image/png"), &[], test_png())).await;
    answer.png(W, H);
    assert!(answer.headers.get("server-timing").is_none());
}

#[tokio::test]
async fn smallest_accepted_image_and_a_crafted_png_decode() {
    // 8x8 is the default minimum side; the crafted file also shows that
    // `crafted_gray_png` writes valid PNGs (the bomb test relies on it).
    let rows: Vec<u8> = (0..8).flat_map(|_| [0u8; 9]).collect();
    let answer = send(
        &fixture_app(),
        post(Some("image/png"), &[], crafted_gray_png(8, 8, &rows)),
    )
    .await;
    answer.png(8, 8);
}

// ---- bad input: one refusal each, and the server keeps answering ----

#[tokio::test]
async fn empty_body_is_400_empty_body() {
    let app = fixture_app();
    send(&app, post(Some("image/png"), &[], Vec::new()))
        .await
        .refused(StatusCode::BAD_REQUEST, "empty_body");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn random_bytes_are_415_unknown_format() {
    let app = fixture_app();
    send(
        &app,
        post(Some("application/octet-stream"), &[], noise(4096)),
    )
    .await
    .refused(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unknown_format");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn truncated_jpeg_is_400_truncated_image() {
    let app = fixture_app();
    let jpeg = jpeg_bytes(&bright_rectangle(W, H), 95);
    send(
        &app,
        post(Some("image/jpeg"), &[], jpeg[..jpeg.len() / 2].to_vec()),
    )
    .await
    .refused(StatusCode::BAD_REQUEST, "truncated_image");
    // A real photo cut in its scan data: the `image` crate alone answers it with the
    // missing rows grey.
    let photo = std::fs::read(fetched("photo-1920x1080.jpg")).unwrap();
    for cut in [photo.len() * 3 / 5, photo.len() - 100] {
        send(&app, post(Some("image/jpeg"), &[], photo[..cut].to_vec()))
            .await
            .refused(StatusCode::BAD_REQUEST, "truncated_image");
    }
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn truncated_png_is_400_truncated_image() {
    let app = fixture_app();
    let png = test_png();
    send(
        &app,
        post(Some("image/png"), &[], png[..png.len() / 2].to_vec()),
    )
    .await
    .refused(StatusCode::BAD_REQUEST, "truncated_image");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn formats_without_a_decoder_are_415() {
    let app = fixture_app();
    // ICO is recognised (its magic bytes) but not built in.
    let mut ico = vec![0, 0, 1, 0, 1, 0, 16, 16, 0, 0, 1, 0, 32, 0];
    ico.extend_from_slice(&[0; 64]);
    send(&app, post(Some("image/x-icon"), &[], ico))
        .await
        .refused(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_format");
    // PDF and SVG are not images the decoder knows at all.
    let pdf = b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n";
    send(
        &app,
        post(Some("application/octet-stream"), &[], pdf.to_vec()),
    )
    .await
    .refused(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unknown_format");
    let svg = br#"<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect width="32" height="32"/></svg>"#;
    send(&app, post(Some("image/svg+xml"), &[], svg.to_vec()))
        .await
        .refused(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unknown_format");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn text_plain_is_415_unsupported_content_type() {
    let app = fixture_app();
    send(&app, post(Some("text/plain"), &[], test_png()))
        .await
        .refused(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_content_type",
        );
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn missing_content_type_is_415_unsupported_content_type() {
    let app = fixture_app();
    send(&app, post(None, &[], test_png())).await.refused(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_content_type",
    );
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn malformed_json_is_400_malformed_json() {
    let app = fixture_app();
    for body in [
        &b"{\"image\": "[..],
        b"[1, 2, 3]",
        b"{\"picture\": \"aGVsbG8=\"}",
        b"{}",
        b"{\"image\": \"aGVsbG8=\", \"url\": \"http://127.0.0.1/x.png\"}",
    ] {
        send(&app, post(Some("application/json"), &[], body.to_vec()))
            .await
            .refused(StatusCode::BAD_REQUEST, "malformed_json");
    }
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn non_base64_image_is_400_invalid_base64() {
    let app = fixture_app();
    let body = serde_json::to_vec(&serde_json::json!({ "image": "not base64 at all!" })).unwrap();
    send(&app, post(Some("application/json"), &[], body))
        .await
        .refused(StatusCode::BAD_REQUEST, "invalid_base64");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn url_when_fetching_is_off_is_400_url_fetch_disabled() {
    let app = fixture_app();
    let body =
        serde_json::to_vec(&serde_json::json!({ "url": "http://127.0.0.1:9/x.png" })).unwrap();
    send(&app, post(Some("application/json"), &[], body))
        .await
        .refused(StatusCode::BAD_REQUEST, "url_fetch_disabled");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn header_declaring_too_many_pixels_is_413_without_allocating() {
    let app = fixture_app();
    // 60000 x 60000 = 3.6 GP (10.8 GB as RGB) declared by a 70-byte file.
    let bomb = crafted_gray_png(60_000, 60_000, &[0; 16]);
    assert!(bomb.len() < 100);
    send(&app, post(Some("image/png"), &[], bomb))
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, "too_many_pixels");
    let largest = LARGEST_ALLOCATION.load(Ordering::Relaxed);
    assert!(largest > 0, "the tracking allocator is not installed");
    assert!(
        largest < 1 << 30,
        "something in this test binary allocated {largest} bytes at once"
    );
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn a_side_over_16384_is_413_image_too_long() {
    let app = fixture_app();
    // 20000 x 8 = 160 000 pixels, well under the pixel limit; the side is what is refused
    // (GPU buffers are sized for sides up to 16384).
    let strip = crafted_gray_png(20_000, 8, &[0; 16]);
    send(&app, post(Some("image/png"), &[], strip))
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, "image_too_long");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn body_over_the_limit_is_413_payload_too_large() {
    let png = test_png();
    let app = fixture_app_with(StateOptions {
        limits: limits(png.len()),
        ..StateOptions::default()
    });
    // At the limit: accepted.
    send(&app, post(Some("image/png"), &[], png.clone()))
        .await
        .png(W, H);
    // Declared over the limit by Content-Length: refused before the body is read.
    let over = noise(png.len() + 1);
    let request = Request::post("/invocations")
        .header(header::CONTENT_TYPE, "image/png")
        .header(header::CONTENT_LENGTH, over.len())
        .body(Body::from(over.clone()))
        .unwrap();
    send(&app, request)
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    // No Content-Length: refused while reading.
    send(&app, post(Some("image/png"), &[], over))
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    // Inside a JSON body the limit is on the JSON.
    let json = serde_json::to_vec(&serde_json::json!({
        "image": base64::engine::general_purpose::STANDARD.encode(&png),
    }))
    .unwrap();
    send(&app, post(Some("application/json"), &[], json))
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn one_pixel_image_is_422_image_too_small() {
    let app = fixture_app();
    let tiny = png_bytes(&image::RgbImage::new(1, 1));
    send(&app, post(Some("image/png"), &[], tiny))
        .await
        .refused(StatusCode::UNPROCESSABLE_ENTITY, "image_too_small");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn accept_text_html_is_406_not_acceptable() {
    let app = fixture_app();
    send(
        &app,
        post(Some("image/png"), &[("accept", "text/html")], test_png()),
    )
    .await
    .refused(StatusCode::NOT_ACCEPTABLE, "not_acceptable");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn unknown_output_attribute_is_400_bad_custom_attribute() {
    let app = fixture_app();
    send(
        &app,
        post(
            Some("image/png"),
            &[(CUSTOM_ATTRIBUTES, "output=sepia")],
            test_png(),
        ),
    )
    .await
    .refused(StatusCode::BAD_REQUEST, "bad_custom_attribute");
    assert_ping_ok(&app).await;
}

#[tokio::test]
async fn unknown_paths_and_methods_are_json_refusals() {
    let app = fixture_app();
    let answer = send(
        &app,
        Request::get("/invocations").body(Body::empty()).unwrap(),
    )
    .await;
    answer.refused(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    assert_eq!(answer.headers[header::ALLOW], "POST");
    let answer = send(&app, post(Some("image/png"), &[], test_png())).await;
    answer.png(W, H);
    let request = Request::post("/nowhere")
        .header(header::CONTENT_TYPE, "image/png")
        .body(Body::from(test_png()))
        .unwrap();
    send(&app, request)
        .await
        .refused(StatusCode::NOT_FOUND, "not_found");
}

#[tokio::test]
async fn request_past_its_deadline_is_503_deadline_exceeded() {
    let app = fixture_app_with(StateOptions {
        limits: RequestLimits {
            deadline: Duration::ZERO,
            ..limits(1 << 20)
        },
        ..StateOptions::default()
    });
    send(&app, post(Some("image/png"), &[], test_png()))
        .await
        .refused(StatusCode::SERVICE_UNAVAILABLE, "deadline_exceeded");
    assert_ping_ok(&app).await;
}

/// One CPU replica of `spec`, returned before it has loaded.
fn unloaded_state(spec: &celer::spec::PipelineSpec) -> AppState {
    use celer::replica::cpu::cpu_device_setup;
    use celer::sched::{Scheduler, SchedulerConfig};
    let devices = vec![cpu_device_setup(spec, 1, 1, 0, &[], celer::pixels::heap())];
    let router = Scheduler::start(
        devices,
        SchedulerConfig {
            queue_capacity: 4,
            ..Default::default()
        },
    );
    AppState::new(router, FrontEnd::new(limits(1 << 20), spec.default_output))
}

#[tokio::test]
async fn ping_is_503_while_loading_and_after_a_failed_load() {
    // Loading: U2NetP takes ~0.1 s to load, a ping microseconds; should the machine be
    // slow enough for the load to win, only the 200 after it is checked.
    let spec = celer::cli::load_pipeline(&model_dir("u2netp")).unwrap();
    let state = Arc::new(unloaded_state(&spec));
    let app = routes(state.clone());
    let answer = send(&app, Request::get("/ping").body(Body::empty()).unwrap()).await;
    if answer.status != StatusCode::OK {
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        let json = answer.json();
        assert_eq!(json["status"], "loading", "{json}");
        assert_eq!(json["replicas"], 1, "{json}");
        assert_eq!(json["replicas_loaded"], 0, "{json}");
    }
    state.scheduler.wait_ready().unwrap();
    assert_ping_ok(&app).await;

    // Failed: a model file that is not a model.
    let dir = tempfile::tempdir().unwrap();
    let toml = std::fs::read_to_string(fixture_dir("prob-guided").join("celer.toml"))
        .unwrap()
        .replace("model = \"../prob.onnx\"", "model = \"bogus.onnx\"");
    assert!(toml.contains("bogus.onnx"));
    std::fs::write(dir.path().join("celer.toml"), toml).unwrap();
    std::fs::write(dir.path().join("bogus.onnx"), b"not a model").unwrap();
    let spec = celer::cli::load_pipeline(dir.path()).unwrap();
    let state = unloaded_state(&spec);
    assert!(state.scheduler.wait_ready().is_err());
    let app = routes(Arc::new(state));
    let answer = send(&app, Request::get("/ping").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json()["status"], "failed");
    // Nothing can run the request; the answer still says so in JSON.
    let answer = send(&app, post(Some("image/png"), &[], test_png())).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(answer.json()["code"].is_string());
}

// ---- over real sockets ----

/// Serves `app` on 127.0.0.1 for the rest of the test's runtime.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn answer_of(response: reqwest::Response) -> Answer {
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let mut headers = HeaderMap::new();
    for (k, v) in response.headers() {
        headers.insert(
            header::HeaderName::from_bytes(k.as_str().as_bytes()).unwrap(),
            header::HeaderValue::from_bytes(v.as_bytes()).unwrap(),
        );
    }
    Answer {
        status,
        headers,
        body: response.bytes().await.unwrap(),
    }
}

async fn ping_over(client: &reqwest::Client, addr: SocketAddr) -> StatusCode {
    let response = client
        .get(format!("http://{addr}/ping"))
        .send()
        .await
        .unwrap();
    StatusCode::from_u16(response.status().as_u16()).unwrap()
}

/// One HTTP/1.1 request written by hand (`head` without the blank line) and `chunks` sent
/// with chunked transfer encoding; the raw answer, read until the server closes.
fn chunked_request(addr: SocketAddr, head: &str, chunks: &[&[u8]]) -> (StatusCode, Vec<u8>) {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut request =
        format!("{head}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").into_bytes();
    for chunk in chunks {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    // The server may answer and close before it has read everything: a failed write is
    // not the test's failure, the answer is.
    let _ = stream.write_all(&request);
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let body_start = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(raw.len(), |p| p + 4);
    (
        StatusCode::from_u16(status).unwrap(),
        raw[body_start..].to_vec(),
    )
}

#[tokio::test]
async fn body_over_the_limit_is_413_over_a_socket_with_and_without_content_length() {
    let png = test_png();
    let limit = png.len();
    let addr = serve(fixture_app_with(StateOptions {
        limits: limits(limit),
        ..StateOptions::default()
    }))
    .await;
    let client = client();

    // Content-Length (reqwest sends it for a byte body).
    let response = client
        .post(format!("http://{addr}/invocations"))
        .header("content-type", "image/png")
        .body(noise(limit * 4))
        .send()
        .await
        .unwrap();
    answer_of(response)
        .await
        .refused(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");

    // Chunked, under the limit: accepted.
    let head = format!("POST /invocations HTTP/1.1\r\nHost: {addr}\r\nContent-Type: image/png");
    let (status, body) = {
        let (head, png) = (head.clone(), png.clone());
        tokio::task::spawn_blocking(move || {
            let (a, b) = png.split_at(png.len() / 2);
            chunked_request(addr, &head, &[a, b])
        })
        .await
        .unwrap()
    };
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));

    // Chunked, over the limit: no Content-Length to refuse on, refused while reading.
    let (status, body) = tokio::task::spawn_blocking(move || {
        let over = noise(limit * 3);
        let chunks: Vec<&[u8]> = over.chunks(limit / 2 + 1).collect();
        chunked_request(addr, &head, &chunks)
    })
    .await
    .unwrap();
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("\"code\":\"payload_too_large\""),
        "body: {text:?}"
    );

    assert_eq!(ping_over(&client, addr).await, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_503_overloaded_with_retry_after_and_the_server_recovers() {
    // One replica, one queue slot: of 8 simultaneous requests one runs, one waits, the
    // rest are refused at once.
    let state = app_state(
        &model_dir("u2netp"),
        StateOptions {
            replicas: 1,
            threads: 1,
            queue_capacity: 1,
            ..StateOptions::default()
        },
    );
    let addr = serve(routes(Arc::new(state))).await;
    let client = client();
    let body = Bytes::from(png_bytes(&bright_rectangle(160, 120)));
    let requests: Vec<_> = (0..8)
        .map(|_| {
            let (client, body) = (client.clone(), body.clone());
            tokio::spawn(async move {
                let response = client
                    .post(format!("http://{addr}/invocations"))
                    .header("content-type", "image/png")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                answer_of(response).await
            })
        })
        .collect();
    let (mut ok, mut overloaded) = (0, 0);
    for request in requests {
        let answer = request.await.unwrap();
        if answer.status == StatusCode::OK {
            answer.png(160, 120);
            ok += 1;
        } else {
            answer.refused(StatusCode::SERVICE_UNAVAILABLE, "overloaded");
            let retry_after = answer
                .headers
                .get(header::RETRY_AFTER)
                .expect("a Retry-After header on 503")
                .to_str()
                .unwrap();
            assert!(
                retry_after.parse::<u32>().is_ok_and(|s| s >= 1),
                "{retry_after}"
            );
            overloaded += 1;
        }
    }
    assert!(ok >= 1, "no request succeeded ({overloaded} overloaded)");
    assert!(overloaded >= 1, "no request was refused ({ok} succeeded)");

    assert_eq!(ping_over(&client, addr).await, StatusCode::OK);
    let response = client
        .post(format!("http://{addr}/invocations"))
        .header("content-type", "image/png")
        .body(body)
        .send()
        .await
        .unwrap();
    answer_of(response).await.png(160, 120);
}

#[tokio::test]
async fn u2netp_over_a_socket_honours_exif_orientation() {
    let addr = serve(routes(Arc::new(app_state(
        &model_dir("u2netp"),
        StateOptions::default(),
    ))))
    .await;
    // Stored 300x451 with orientation 6: upright it is 451x300.
    let jpeg = std::fs::read(fetched("chelsea-exif6.jpg")).unwrap();
    let response = client()
        .post(format!("http://{addr}/invocations"))
        .header("content-type", "image/jpeg")
        .body(jpeg)
        .send()
        .await
        .unwrap();
    let cutout = answer_of(response).await.png(451, 300);
    assert_eq!(cutout.color(), image::ColorType::Rgba8);
    let alpha: Vec<u8> = cutout.into_rgba8().pixels().map(|p| p[3]).collect();
    let opaque = alpha.iter().filter(|&&a| a >= 128).count() as f64 / alpha.len() as f64;
    assert!(
        (0.05..0.95).contains(&opaque),
        "the cat should be part of the picture, not all or none of it: {opaque:.3} opaque"
    );
}

// ---- URL fetching ----

/// A second server: `/x.png` is a PNG, `/big.png` is `big` bytes, anything else 404.
async fn image_server(png: Vec<u8>, big: usize) -> SocketAddr {
    let app = Router::new()
        .route(
            "/x.png",
            axum::routing::get(move || async move { ([(header::CONTENT_TYPE, "image/png")], png) }),
        )
        .route(
            "/big.png",
            axum::routing::get(move || async move {
                ([(header::CONTENT_TYPE, "image/png")], vec![0u8; big])
            }),
        );
    serve(app).await
}

fn url_body(url: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "url": url })).unwrap()
}

#[tokio::test]
async fn url_from_an_allowed_host_is_fetched() {
    let images = image_server(test_png(), 0).await;
    let app = fixture_app_with(StateOptions {
        fetcher: UrlFetcher::new(&["127.0.0.1".into()], Duration::from_secs(2), 64 * 1024),
        ..StateOptions::default()
    });
    let answer = send(
        &app,
        post(
            Some("application/json"),
            &[],
            url_body(&format!("http://{images}/x.png")),
        ),
    )
    .await;
    let rgba = answer.png(W, H).into_rgba8();
    let alpha = GrayImage::from_fn(W, H, |x, y| image::Luma([rgba.get_pixel(x, y)[3]]));
    assert_rectangle_cut_out(&alpha);
}

#[tokio::test]
async fn url_fetching_refusals() {
    let limit = 64 * 1024;
    let images = image_server(test_png(), limit + 1).await;
    let app = fixture_app_with(StateOptions {
        fetcher: UrlFetcher::new(&["127.0.0.1".into()], Duration::from_secs(2), limit),
        ..StateOptions::default()
    });
    let port = images.port();
    for (url, status, code) in [
        (
            format!("http://localhost:{port}/x.png"),
            StatusCode::FORBIDDEN,
            "url_not_allowed",
        ),
        (
            format!("http://127.0.0.2:{port}/x.png"),
            StatusCode::FORBIDDEN,
            "url_not_allowed",
        ),
        (
            format!("ftp://127.0.0.1:{port}/x.png"),
            StatusCode::BAD_REQUEST,
            "bad_url",
        ),
        ("not a url".to_string(), StatusCode::BAD_REQUEST, "bad_url"),
        (
            format!("http://127.0.0.1:{port}/missing.png"),
            StatusCode::BAD_GATEWAY,
            "fetch_failed",
        ),
        (
            format!("http://127.0.0.1:{port}/big.png"),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ] {
        let answer = send(&app, post(Some("application/json"), &[], url_body(&url))).await;
        let json = answer.json();
        assert_eq!(answer.status, status, "{url}: {json}");
        assert_eq!(json["code"], code, "{url}: {json}");
    }
    assert_ping_ok(&app).await;
}

/// A listed host *name* that resolves to internal addresses (here `localhost`) is
/// refused before any connection: the allow-list cannot be turned into a way into the
/// server's own network by DNS. A listed IP literal (above) is fetched as is.
#[tokio::test]
async fn an_allowed_name_that_resolves_inside_the_network_is_refused() {
    let images = image_server(test_png(), 0).await;
    let app = fixture_app_with(StateOptions {
        fetcher: UrlFetcher::new(&["localhost".into()], Duration::from_secs(2), 64 * 1024),
        ..StateOptions::default()
    });
    let url = format!("http://localhost:{}/x.png", images.port());
    let answer = send(&app, post(Some("application/json"), &[], url_body(&url))).await;
    let json = answer.json();
    assert_eq!(answer.status, StatusCode::FORBIDDEN, "{json}");
    assert_eq!(json["code"], "url_not_allowed", "{json}");
    let message = json["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("resolves only to internal addresses"),
        "{message}"
    );
    assert_ping_ok(&app).await;
}

// ---- the binary ----

/// Kills the server if the test fails before it has stopped it.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Each thread of process `pid` (its main thread first): its name and nice value, from
/// `/proc/PID/task/TID/stat` (the 19th field; the name in brackets may hold spaces).
fn thread_priorities(pid: u32) -> Vec<(String, i64)> {
    let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_by_key(|&tid| (tid != pid, tid));
    tids.iter()
        .filter_map(|tid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
            let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
            let nice = rest.split_whitespace().nth(16)?.parse().ok()?;
            Some((name.to_string(), nice))
        })
        .collect()
}

#[tokio::test]
async fn the_binary_serves_is_benched_and_stops_cleanly_on_sigterm() {
    let model = model_dir("u2netp");
    let jpeg = std::fs::read(fetched("astronaut.jpg")).unwrap();
    let (width, height) = image::load_from_memory(&jpeg)
        .unwrap()
        .into_rgb8()
        .dimensions();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_celer"))
            .args(["serve", "--model-dir"])
            .arg(&model)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--replicas", "1", "--threads-per-replica", "1"])
            .args(["--grpc-port", "0"])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.reopen().unwrap())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("starting celer serve"),
    );
    let server_log = || std::fs::read_to_string(log.path()).unwrap_or_default();
    let base = format!("http://127.0.0.1:{port}");

    {
        let client = client();
        let started = Instant::now();
        loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                panic!("celer serve exited with {status}:\n{}", server_log());
            }
            if let Ok(r) = client.get(format!("{base}/ping")).send().await {
                if r.status() == reqwest::StatusCode::OK {
                    break;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "/ping did not answer 200 within 30 s:\n{}",
                server_log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let response = client
            .post(format!("{base}/invocations"))
            .header("content-type", "image/jpeg")
            .body(jpeg)
            .send()
            .await
            .unwrap();
        let cutout = answer_of(response).await.png(width, height);
        assert_eq!(cutout.color(), image::ColorType::Rgba8);
        // The client (and its kept-alive connection) goes before the signal.
    }

    // The runtime's threads yield contended cores to the replicas and the request path's
    // CPU work, which keep the process's priority (`host::priority`).
    let threads = thread_priorities(child.0.id());
    let process = threads[0].1;
    let at = |prefix: &str| -> Vec<i64> {
        threads
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|&(_, nice)| nice)
            .collect()
    };
    let (runtime, work, replicas) = (at("tokio-rt-worker"), at("celer-work-"), at("celer-cpu-"));
    assert!(runtime.contains(&(process + 10).min(19)), "{threads:?}");
    assert!(
        !work.is_empty() && work.iter().all(|&n| n == process),
        "{threads:?}"
    );
    assert!(
        !replicas.is_empty() && replicas.iter().all(|&n| n == process),
        "{threads:?}"
    );

    // `celer bench http` loads the server over sockets and counts the server's CPU time
    // (its process, from /proc) and its own per request.
    let report = tempfile::NamedTempFile::new().unwrap();
    let bench = Command::new(env!("CARGO_BIN_EXE_celer"))
        .args(["bench", "http", "--url", &base, "--input"])
        .arg(fetched("astronaut.jpg"))
        .args([
            "--concurrency",
            "2",
            "--duration-s",
            "3",
            "--warmup-s",
            "0.5",
        ])
        .args(["--server-pid", &child.0.id().to_string(), "--json"])
        .arg(report.path())
        .output()
        .expect("running celer bench http");
    assert!(bench.status.success(), "{}", common::printed(&bench));
    let points: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.path()).unwrap()).unwrap();
    let point = &points[0];
    assert_eq!(point["point"], "c=2", "{points}");
    assert!(point["ok"].as_u64().unwrap() > 0, "{points}");
    assert_eq!(point["errors"], serde_json::json!({}), "{points}");
    // The server ran the model for each request (hundreds of ms of CPU); the client's
    // share may be under the 10 ms the kernel counts in, so it is only present.
    let server = point["server_cpu_ms_per_request"].as_f64();
    assert!(server.is_some_and(|ms| ms > 10.0), "{points}");
    let client = point["client_cpu_ms_per_request"].as_f64();
    assert!(client.is_some_and(|ms| ms >= 0.0), "{points}");

    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("running kill");
    assert!(status.success());
    let stopping = Instant::now();
    let exit = loop {
        if let Some(exit) = child.0.try_wait().unwrap() {
            break exit;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(30),
            "celer serve did not exit within 30 s of SIGTERM:\n{}",
            server_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        exit.success(),
        "celer serve exited with {exit}:\n{}",
        server_log()
    );
}
