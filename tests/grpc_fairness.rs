//! gRPC fairness against `celer serve` over sockets: what one client does on its
//! connections cannot deny the port to the others. Streams that send half a message or
//! none hold at most their connection's share of the calls in transit, and only until
//! the body timers end them; a reader that never opens its window is dropped after the
//! send timeout, and what its answer held is freed; HTTP/2's concurrency limit is
//! enforced with REFUSED_STREAM; a client that makes the server reset streams is sent
//! GOAWAY; and each refusal and cancellation leaves an access line with the status its
//! client got. The well-behaved clients are the `h2` crate's; the hostile frames are
//! written by hand.

mod common;
mod serve_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, Request};
use bytes::Bytes;
use celer::oip::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use celer::oip::inference::ModelInferRequest;
use h2::client::SendRequest;
use prost::Message;

use common::{fetched, model_dir};
use serve_support::{free_port, Server};

/// gRPC status codes the tests read.
const OK: i32 = 0;
const DEADLINE_EXCEEDED: i32 = 4;
const RESOURCE_EXHAUSTED: i32 = 8;

/// `celer serve` with gRPC on a free port, one replica, and `args`; returns it and the
/// gRPC address.
fn serve(args: &[&str]) -> (Server, SocketAddr) {
    let port = free_port();
    let mut all = vec!["--grpc-port".to_string(), port.to_string()];
    all.extend(["--replicas", "1"].map(String::from));
    all.extend(args.iter().map(|a| a.to_string()));
    let server = Server::start(&model_dir("u2netp"), all, &[]);
    let grpc = SocketAddr::from(([127, 0, 0, 1], port));
    assert!(
        server
            .log()
            .contains(&format!("grpc_address=127.0.0.1:{port}")),
        "no gRPC listener in the log:\n{}",
        server.log()
    );
    (server, grpc)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A message as gRPC frames it: no compression, its length, its bytes.
fn grpc_frame(message: &[u8]) -> Bytes {
    let mut framed = vec![0u8];
    framed.extend((message.len() as u32).to_be_bytes());
    framed.extend(message);
    Bytes::from(framed)
}

/// `ModelInfer` of `photo`, asking for the alpha alone.
fn infer_message(photo: &std::path::Path) -> Bytes {
    let image = std::fs::read(photo).expect("the photo");
    let mut element = (image.len() as u32).to_le_bytes().to_vec();
    element.extend(image);
    let request = ModelInferRequest {
        model_name: "celer".into(),
        inputs: vec![InferInputTensor {
            name: "image".into(),
            datatype: "BYTES".into(),
            shape: vec![1],
            ..Default::default()
        }],
        outputs: vec![InferRequestedOutputTensor {
            name: "alpha".into(),
            ..Default::default()
        }],
        raw_input_contents: vec![Bytes::from(element)],
        ..Default::default()
    };
    grpc_frame(&request.encode_to_vec())
}

fn call_head(path: &str) -> Request<()> {
    Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a request head")
}

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// One HTTP/2 connection of the `h2` client, whose streams' windows start at `window`
/// (0: a reader that never reads); it answers the server's PINGs while it lives.
struct Client {
    send: SendRequest<Bytes>,
    connection: tokio::task::JoinHandle<Result<(), h2::Error>>,
}

async fn connect(address: SocketAddr, window: u32) -> Client {
    let socket = tokio::net::TcpStream::connect(address)
        .await
        .expect("connects");
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .max_concurrent_reset_streams(4096)
        .handshake::<_, Bytes>(socket)
        .await
        .expect("an HTTP/2 handshake");
    Client {
        send,
        connection: tokio::spawn(connection),
    }
}

/// How a call ended for its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The gRPC status it read (after the whole answer).
    Status(i32),
    /// Its stream was reset with this HTTP/2 error code.
    Reset(u32),
    /// Its connection went away under it.
    Gone,
}

fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

fn failed(e: &h2::Error) -> Outcome {
    match e.reason() {
        Some(reason) if !e.is_go_away() => Outcome::Reset(reason.into()),
        _ => Outcome::Gone,
    }
}

/// Reads a call's answer to its end (opening the window as it reads).
async fn outcome(response: h2::client::ResponseFuture) -> Outcome {
    let response = match response.await {
        Ok(r) => r,
        Err(e) => return failed(&e),
    };
    if let Some(status) = grpc_status(response.headers()) {
        return Outcome::Status(status);
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        match chunk {
            Ok(data) => {
                let _ = body.flow_control().release_capacity(data.len());
            }
            Err(e) => return failed(&e),
        }
    }
    match body.trailers().await {
        Ok(trailers) => Outcome::Status(trailers.as_ref().and_then(grpc_status).unwrap_or(-1)),
        Err(e) => failed(&e),
    }
}

/// Calls `MODEL_INFER` with `message` on `client` and reads its answer.
async fn model_infer(client: &mut Client, message: Bytes) -> Outcome {
    let send = match client.send.clone().ready().await {
        Ok(s) => s,
        Err(e) => return failed(&e),
    };
    client.send = send;
    let (response, mut stream) = match client.send.send_request(call_head(MODEL_INFER), false) {
        Ok(pair) => pair,
        Err(e) => return failed(&e),
    };
    let _ = stream.send_data(message, true);
    outcome(response).await
}

/// Another client's `ModelInfer` calls, one after another on their own connection, until
/// `attack` has ended (at least one): each one's outcome and time.
async fn served_meanwhile(
    address: SocketAddr,
    message: Bytes,
    attack: &Attack,
) -> Vec<(Outcome, Duration)> {
    let mut client = connect(address, 65_535).await;
    let mut calls = Vec::new();
    while calls.is_empty() || !attack.ended() {
        let started = Instant::now();
        let outcome = model_infer(&mut client, message.clone()).await;
        calls.push((outcome, started.elapsed()));
    }
    calls
}

/// Every call of the other client was answered OK.
fn all_answered(calls: &[(Outcome, Duration)], server: &Server) {
    let slowest = calls.iter().map(|c| c.1).max().unwrap_or_default();
    eprintln!(
        "the other client: {} calls, slowest {slowest:?}",
        calls.len()
    );
    for (i, (outcome, took)) in calls.iter().enumerate() {
        assert_eq!(
            *outcome,
            Outcome::Status(OK),
            "the other client's call {i} ({took:?}) was not answered:\n{}",
            server.log()
        );
    }
}

/// The access lines (target `celer::access`) of gRPC calls to `path` that say `field`.
fn access_lines(log: &str, path: &str, field: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("celer::access") && l.contains("method=\"gRPC\""))
        .filter(|l| l.contains(&format!("path={path}")) && l.contains(field))
        .count()
}

/// Streams opened one after another on one connection, each with `sent` (the start of a
/// message, or nothing) and never ended from this side: the server must end them.
struct Attack {
    answers: Vec<tokio::task::JoinHandle<Outcome>>,
    _streams: Vec<h2::SendStream<Bytes>>,
    _client: Client,
}

impl Attack {
    /// Opens `count` such streams; returns once each is sent. A first call (ServerLive)
    /// waits for the server's SETTINGS, so that the streams keep to its concurrency limit.
    async fn open(address: SocketAddr, count: usize, sent: Option<Bytes>) -> Attack {
        let mut client = connect(address, 65_535).await;
        let live = grpc_frame(&[]);
        let (response, mut stream) = client
            .send
            .send_request(
                call_head("/inference.GRPCInferenceService/ServerLive"),
                false,
            )
            .expect("a stream");
        let _ = stream.send_data(live, true);
        assert_eq!(outcome(response).await, Outcome::Status(OK));
        // Its place in transit goes back once hyper has sent its trailers.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut answers = Vec::with_capacity(count);
        let mut streams = Vec::with_capacity(count);
        for _ in 0..count {
            client.send = client.send.clone().ready().await.expect("a stream");
            let (response, mut stream) = client
                .send
                .send_request(call_head(MODEL_INFER), false)
                .expect("a stream");
            if let Some(part) = &sent {
                stream.reserve_capacity(part.len());
                let _ = stream.send_data(part.clone(), false);
            }
            streams.push(stream);
            answers.push(tokio::spawn(outcome(response)));
        }
        Attack {
            answers,
            _streams: streams,
            _client: client,
        }
    }

    /// Every stream has ended.
    fn ended(&self) -> bool {
        self.answers.iter().all(|a| a.is_finished())
    }

    async fn outcomes(self) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(self.answers.len());
        for answer in self.answers {
            outcomes.push(answer.await.expect("read"));
        }
        outcomes
    }
}

/// `count` stalled streams (sending `sent` each) on one connection while another client
/// calls `ModelInfer`: that client is answered throughout; the stalled streams are each
/// refused at once (RESOURCE_EXHAUSTED, past their connection's share) or ended by the
/// body timers (DEADLINE_EXCEEDED), and each has its access line.
fn stalled_streams_leave_the_others_served(count: usize, sent: Option<Bytes>) {
    // One replica, two queue places: admission takes 3 at once, each connection's share.
    // The server-wide cap: 8 messages of 1 MB (REST's memory for bodies): before shares,
    // one connection's stalled streams held all 8 and the port refused everyone else.
    let (server, grpc) = serve(&[
        "--queue-capacity",
        "2",
        "--max-body-bytes",
        "1000000",
        "--body-buffer-bytes",
        "8000000",
        "--body-idle-timeout-ms",
        "2000",
        "--body-timeout-ms",
        "4000",
    ]);
    let message = infer_message(&fetched("photo-320x320.jpg"));
    let started = Instant::now();
    let (stalled, meanwhile) = runtime().block_on(async {
        let attack = Attack::open(grpc, count, sent).await;
        eprintln!(
            "{count} stalled streams sent within {:?}",
            started.elapsed()
        );
        let meanwhile = served_meanwhile(grpc, message, &attack).await;
        (attack.outcomes().await, meanwhile)
    });
    eprintln!(
        "{count} stalled streams ended within {:?}",
        started.elapsed()
    );
    all_answered(&meanwhile, &server);
    let of = |o: Outcome| stalled.iter().filter(|s| **s == o).count();
    let (refused, timed_out) = (
        of(Outcome::Status(RESOURCE_EXHAUSTED)),
        of(Outcome::Status(DEADLINE_EXCEEDED)),
    );
    eprintln!("stalled streams: {refused} refused at once, {timed_out} ended by the body timers");
    assert_eq!(
        refused + timed_out,
        count,
        "each stalled stream refused or timed out: {stalled:?}"
    );
    assert!(timed_out >= 1 && refused >= 1, "{stalled:?}");
    // Each has its access line, with the status its client read.
    let log = server.log();
    let lines =
        |status: &str| access_lines(&log, MODEL_INFER, &format!("grpc_status=\"{status}\""));
    assert!(lines("RESOURCE_EXHAUSTED") >= refused, "{log}");
    assert!(lines("DEADLINE_EXCEEDED") >= timed_out, "{log}");
    assert!(server.stop().success());
}

#[test]
fn half_sent_streams_on_one_connection_leave_the_others_served() {
    // Each announces 2,000 bytes and sends 1,000.
    let mut half = vec![0u8];
    half.extend(2_000u32.to_be_bytes());
    half.extend([0x0a; 995]);
    stalled_streams_leave_the_others_served(2_000, Some(Bytes::from(half)));
}

#[test]
fn headers_only_streams_leave_the_others_served() {
    stalled_streams_leave_the_others_served(64, None);
}

/// Readers that advertise a zero window: their calls are answered, the answers wait in
/// the server for a window that never opens, and the connection answers the server's
/// PINGs (the `h2` client does). Each answer keeps its place in transit until it is
/// delivered (a further call on the connection is refused past its share); after the
/// send timeout the connection is ended, which frees the answers and their places, and
/// the calls are logged CANCELLED with the status that was not delivered.
#[test]
fn readers_that_never_open_their_window_are_dropped_and_their_answers_freed() {
    // Admission takes 2 at once, each connection's share; 4 calls in transit server-wide.
    // A call's time: the 10 s deadline plus the 3 s whole-message time.
    let request_timeout = Duration::from_secs(13);
    let (server, grpc) = serve(&[
        "--queue-capacity",
        "1",
        "--max-body-bytes",
        "1000000",
        "--body-buffer-bytes",
        "4000000",
        "--deadline-s",
        "10",
        "--body-timeout-ms",
        "3000",
        "--send-timeout-ms",
        "6000",
    ]);
    let message = infer_message(&fetched("photo-320x320.jpg"));
    runtime().block_on(async {
        let mut reader = connect(grpc, 0).await;
        let first = Instant::now();
        let mut held = Vec::new();
        for _ in 0..2 {
            reader.send = reader.send.clone().ready().await.expect("a stream");
            let (response, mut stream) = reader
                .send
                .send_request(call_head(MODEL_INFER), false)
                .expect("a stream");
            let _ = stream.send_data(message.clone(), true);
            // The answer's head: the call is answered, its data waits for the window.
            let response = response.await.expect("an answer's head");
            assert_eq!(grpc_status(response.headers()), None, "{response:?}");
            held.push((response, stream));
        }
        // The two answers hold the connection's share.
        let third = model_infer(&mut reader, message.clone()).await;
        assert_eq!(third, Outcome::Status(RESOURCE_EXHAUSTED));
        // The server ends the connection, within the calls' time (waited for a while
        // longer, to fail rather than hang when it does not).
        let ended = tokio::time::timeout(request_timeout * 2, reader.connection).await;
        let took = first.elapsed();
        eprintln!("the zero-window reader was dropped {took:?} after its first call");
        assert!(
            took < request_timeout,
            "dropped after {took:?}: {ended:?}\n{}",
            server.log()
        );
        // Freed: another connection is served.
        let mut other = connect(grpc, 65_535).await;
        assert_eq!(
            model_infer(&mut other, message.clone()).await,
            Outcome::Status(OK)
        );
        // A call its client cancels before the answer.
        other.send = other.send.clone().ready().await.expect("a stream");
        let (_response, mut stream) = other
            .send
            .send_request(call_head(MODEL_INFER), false)
            .expect("a stream");
        tokio::time::sleep(Duration::from_millis(300)).await;
        stream.send_reset(h2::Reason::CANCEL);
    });
    // The cancelled call's line: written when the server sees the reset.
    let cancelled = |log: &str| access_lines(log, MODEL_INFER, "grpc_status=\"CANCELLED\"");
    let waited = Instant::now();
    while cancelled(&server.log()) < 3 && waited.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = server.log();
    assert_eq!(cancelled(&log), 3, "{log}");
    let lines = |field: &str| access_lines(&log, MODEL_INFER, field);
    assert_eq!(
        lines("grpc_status=\"CANCELLED\" undelivered=\"OK\" cause=\"send_timeout\""),
        2,
        "{log}"
    );
    assert_eq!(lines("grpc_status=\"RESOURCE_EXHAUSTED\""), 1, "{log}");
    assert_eq!(lines("grpc_status=\"OK\""), 1, "{log}");
    assert!(
        log.contains("an answer was not read within the send timeout"),
        "{log}"
    );
    assert!(server.stop().success());
}

/// Raw HTTP/2 for what no client library sends: an HTTP/2 frame (24-bit length, type,
/// flags, stream id, payload).
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// HPACK's "literal header field without indexing, new name", lengths under 127.
fn header_block(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in headers {
        block.extend([0, name.len() as u8]);
        block.extend(name.as_bytes());
        block.push(value.len() as u8);
        block.extend(value.as_bytes());
    }
    block
}

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const REFUSED_STREAM: u32 = 0x7;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// A received frame: type, flags, stream, payload.
type Received = (u8, u8, u32, Vec<u8>);

/// An HTTP/2 connection written by hand; it acknowledges the server's SETTINGS and PINGs.
struct RawConnection {
    socket: TcpStream,
    buffer: Vec<u8>,
}

impl RawConnection {
    /// Connects, sends the preface and empty SETTINGS, and waits for the server's.
    fn open(address: SocketAddr) -> Self {
        let socket = TcpStream::connect(address).expect("connects");
        let mut raw = Self {
            socket,
            buffer: Vec::new(),
        };
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        raw.send(&hello);
        let settings = raw.next_frame(Duration::from_secs(10));
        assert!(
            matches!(settings, Some((SETTINGS, 0, 0, _))),
            "{settings:?}"
        );
        raw
    }

    /// Writes `bytes`; false once the server has closed the connection.
    fn send(&mut self, bytes: &[u8]) -> bool {
        self.socket.write_all(bytes).is_ok()
    }

    /// The next frame within `within` (`None`: none came, or the connection closed),
    /// SETTINGS and PINGs acknowledged on the way (and returned).
    fn next_frame(&mut self, within: Duration) -> Option<Received> {
        let until = Instant::now() + within;
        loop {
            if self.buffer.len() >= 9 {
                let b = &self.buffer;
                let length = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
                if b.len() >= 9 + length {
                    let (kind, flags) = (b[3], b[4]);
                    let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff;
                    let payload = b[9..9 + length].to_vec();
                    self.buffer.drain(..9 + length);
                    match (kind, flags & ACK) {
                        (SETTINGS, 0) => {
                            self.send(&frame(SETTINGS, ACK, 0, &[]));
                        }
                        (PING, 0) => {
                            self.send(&frame(PING, ACK, 0, &payload));
                        }
                        _ => {}
                    }
                    return Some((kind, flags, stream, payload));
                }
            }
            let left = until.checked_duration_since(Instant::now())?;
            self.socket
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .expect("a read timeout");
            let mut chunk = [0u8; 16384];
            match self.socket.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

fn request_headers(path: &str) -> Vec<(&str, &str)> {
    vec![
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "127.0.0.1"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
}

/// HTTP/2's concurrency limit holds: 128 streams open at once on a connection (health
/// Watch calls, which stay open), and the 129th is refused with REFUSED_STREAM while the
/// others carry on; another client is served meanwhile.
#[test]
fn streams_past_the_concurrency_limit_are_refused_with_refused_stream() {
    let (server, grpc) = serve(&[]);
    let mut raw = RawConnection::open(grpc);
    let watch = header_block(&request_headers("/grpc.health.v1.Health/Watch"));
    let mut out = Vec::new();
    let streams: Vec<u32> = (0..129).map(|i| 2 * i + 1).collect();
    for &id in &streams {
        out.extend(frame(HEADERS, END_HEADERS, id, &watch));
        // An empty HealthCheckRequest: the server as a whole.
        out.extend(frame(DATA, END_STREAM, id, &grpc_frame(&[])));
    }
    assert!(raw.send(&out));
    let last = *streams.last().unwrap();
    let mut refused = Vec::new();
    let mut watching = std::collections::BTreeSet::new();
    while let Some((kind, _, stream, payload)) = raw.next_frame(Duration::from_secs(10)) {
        match kind {
            RST_STREAM => {
                let code = u32::from_be_bytes(payload[..4].try_into().unwrap());
                refused.push((stream, code));
            }
            DATA => {
                watching.insert(stream);
            }
            GOAWAY => panic!("GOAWAY: {payload:?}"),
            _ => {}
        }
        if !refused.is_empty() && watching.len() >= 128 {
            break;
        }
    }
    // (A second reset of the refused stream, STREAM_CLOSED, answers its DATA frame.)
    assert_eq!(
        refused.first(),
        Some(&(last, REFUSED_STREAM)),
        "{}",
        server.log()
    );
    assert!(refused.iter().all(|r| r.0 == last), "{refused:?}");
    assert_eq!(
        watching.len(),
        128,
        "each of the first 128 streams answered"
    );
    assert!(!watching.contains(&last));
    let message = infer_message(&fetched("photo-320x320.jpg"));
    runtime().block_on(async {
        let mut other = connect(grpc, 65_535).await;
        assert_eq!(model_infer(&mut other, message).await, Outcome::Status(OK));
    });
    drop(raw);
    assert!(server.stop().success());
}

/// A client that makes the server reset stream after stream (each HEADERS malformed: a
/// connection-specific header, which HTTP/2 forbids) is sent GOAWAY with
/// ENHANCE_YOUR_CALM after hyper's limit of such resets (CVE-2025-8671, "MadeYouReset"),
/// and the server serves others meanwhile.
#[test]
fn a_reset_flood_provoked_by_the_client_ends_with_goaway() {
    let (server, grpc) = serve(&[]);
    let mut raw = RawConnection::open(grpc);
    let mut headers = request_headers(MODEL_INFER);
    headers.push(("connection", "close"));
    let block = header_block(&headers);
    let flood = 5_000u32;
    let mut sent = 0;
    for batch in (0..flood).collect::<Vec<_>>().chunks(500) {
        let out: Vec<u8> = batch
            .iter()
            .flat_map(|i| frame(HEADERS, END_HEADERS | END_STREAM, 2 * i + 1, &block))
            .collect();
        if !raw.send(&out) {
            break;
        }
        sent += batch.len();
    }
    let (mut resets, mut goaway) = (0, None);
    while let Some((kind, _, _, payload)) = raw.next_frame(Duration::from_secs(10)) {
        match kind {
            RST_STREAM => resets += 1,
            GOAWAY => {
                eprintln!("GOAWAY: {}", String::from_utf8_lossy(&payload[8..]));
                goaway = Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
                break;
            }
            _ => {}
        }
    }
    eprintln!(
        "{sent} malformed streams sent, {resets} reset by the server, then GOAWAY {goaway:?}"
    );
    assert_eq!(goaway, Some(ENHANCE_YOUR_CALM), "{}", server.log());
    assert!(resets < flood as usize, "{resets}");
    let message = infer_message(&fetched("photo-320x320.jpg"));
    runtime().block_on(async {
        let mut other = connect(grpc, 65_535).await;
        assert_eq!(model_infer(&mut other, message).await, Outcome::Status(OK));
    });
    assert!(server.stop().success());
}

/// Rapid reset (CVE-2023-44487) still closes the connection: streams opened and reset
/// at once by the client, thousands of them, end with GOAWAY (ENHANCE_YOUR_CALM).
#[test]
fn a_rapid_reset_flood_ends_with_goaway() {
    let (server, grpc) = serve(&[]);
    let mut raw = RawConnection::open(grpc);
    let block = header_block(&request_headers(MODEL_INFER));
    let cancel = 0x8u32.to_be_bytes();
    for batch in (0..5_000u32).collect::<Vec<_>>().chunks(500) {
        let out: Vec<u8> = batch
            .iter()
            .flat_map(|i| {
                let mut pair = frame(HEADERS, END_HEADERS, 2 * i + 1, &block);
                pair.extend(frame(RST_STREAM, 0, 2 * i + 1, &cancel));
                pair
            })
            .collect();
        if !raw.send(&out) {
            break;
        }
    }
    let mut goaway = None;
    while let Some((kind, _, _, payload)) = raw.next_frame(Duration::from_secs(10)) {
        if kind == GOAWAY {
            goaway = Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
            break;
        }
    }
    assert_eq!(goaway, Some(ENHANCE_YOUR_CALM), "{}", server.log());
    assert!(server.stop().success());
}

/// The server's resident memory, kB (its /proc status).
fn resident_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// The figure of the report, not a check CI runs (minutes): 200 zero-window readers, each
/// on its own connection answering PINGs, against the default limits (30 s send timeout,
/// 90 s per call), each retrying a refused call until one is answered. Prints how long
/// each was held, and the server's resident memory before, at its peak and after.
/// `cargo test --release --test grpc_fairness -- --ignored --nocapture`
#[test]
#[ignore = "a measurement of minutes: run by hand for the report"]
fn two_hundred_zero_window_readers_measured() {
    let (server, grpc) = serve(&[]);
    let message = {
        let image = std::fs::read(fetched("astronaut.jpg")).expect("the photo");
        let mut element = (image.len() as u32).to_le_bytes().to_vec();
        element.extend(image);
        let request = ModelInferRequest {
            model_name: "celer".into(),
            inputs: vec![InferInputTensor {
                name: "image".into(),
                datatype: "BYTES".into(),
                shape: vec![1],
                ..Default::default()
            }],
            raw_input_contents: vec![Bytes::from(element)],
            ..Default::default()
        };
        grpc_frame(&request.encode_to_vec())
    };
    // Warm: one answer read whole.
    runtime().block_on(async {
        let mut warm = connect(grpc, 65_535).await;
        assert_eq!(
            model_infer(&mut warm, message.clone()).await,
            Outcome::Status(OK)
        );
    });
    std::thread::sleep(Duration::from_secs(2));
    let pid = server.pid();
    let before = resident_kb(pid);
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(before));
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Acquire) {
                peak.fetch_max(resident_kb(pid), std::sync::atomic::Ordering::AcqRel);
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let started = Instant::now();
    let held: Vec<(Duration, Duration, u32)> = runtime().block_on(async {
        let readers = (0..200).map(|_| {
            let message = message.clone();
            tokio::spawn(async move {
                let mut reader = connect(grpc, 0).await;
                let mut tries = 0;
                let (answered, ready) = loop {
                    tries += 1;
                    let asked = Instant::now();
                    reader.send = reader.send.clone().ready().await.expect("a stream");
                    let (response, mut stream) = reader
                        .send
                        .send_request(call_head(MODEL_INFER), false)
                        .expect("a stream");
                    let _ = stream.send_data(message.clone(), true);
                    let response = response.await.expect("an answer's head");
                    if grpc_status(response.headers()).is_none() {
                        // Answered; held by the window, kept (with its stream) until the
                        // server ends the connection.
                        let ready = Instant::now();
                        let _ =
                            tokio::time::timeout(Duration::from_secs(300), &mut reader.connection)
                                .await;
                        drop((response, stream));
                        break (asked, ready);
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                };
                (answered.elapsed(), ready.elapsed(), tries)
            })
        });
        let mut held = Vec::new();
        for r in readers.collect::<Vec<_>>() {
            held.push(r.await.expect("a reader"));
        }
        held
    });
    let all_dropped = started.elapsed();
    let just_after = resident_kb(pid);
    std::thread::sleep(Duration::from_secs(10));
    let after = resident_kb(pid);
    sampling.store(false, std::sync::atomic::Ordering::Release);
    sampler.join().unwrap();
    let longest_call = held.iter().map(|h| h.0).max().unwrap();
    let longest_held = held.iter().map(|h| h.1).max().unwrap();
    let tries: u32 = held.iter().map(|h| h.2).sum();
    eprintln!(
        "200 zero-window readers: all dropped {all_dropped:?} after the first came; \
         each dropped at most {longest_call:?} after the head of its answered call and \
         {longest_held:?} after its answer was ready ({tries} calls in all, the rest refused and retried)"
    );
    eprintln!(
        "resident memory: before {} MB, peak {} MB, just after {} MB, 10 s after {} MB",
        before / 1024,
        peak.load(std::sync::atomic::Ordering::Acquire) / 1024,
        just_after / 1024,
        after / 1024
    );
    let log = server.log();
    eprintln!(
        "access lines: {} CANCELLED (send_timeout), {} OK",
        access_lines(&log, MODEL_INFER, "cause=\"send_timeout\""),
        access_lines(&log, MODEL_INFER, "grpc_status=\"OK\"")
    );
    assert!(server.stop().success());
}
