//! `celer serve` as a process, for the tests that talk to it as SageMaker, KServe or a
//! client library would: started on a free port (the address read from its log),
//! waited for until `/ping` answers 200, its log kept, killed if a test fails first.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use image::RgbaImage;

/// A running `celer serve`.
/// The address of the "listening" line, in the text or the JSON log format.
fn listening_address(line: &str) -> Option<String> {
    if line.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        return (v["message"] == "listening")
            .then(|| v["address"].as_str().map(str::to_string))
            .flatten();
    }
    if !line.contains("listening") {
        return None;
    }
    let at = line.split("address=").nth(1)?;
    Some(at.split_whitespace().next().unwrap_or("").to_string())
}

pub struct Server {
    child: Option<Child>,
    pub address: SocketAddr,
    log: Arc<Mutex<String>>,
}

/// A port free now, for a listener a test names up front (`--grpc-port`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Server {
    /// Starts `celer serve --model-dir model_dir ARGS` on 127.0.0.1 with `env` added (and
    /// the SageMaker variables a test did not name removed) and waits until `/ping`
    /// answers 200 (at most 60 s).
    pub fn start<I, S>(model_dir: &Path, args: I, env: &[(&str, &str)]) -> Server
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Self::spawn(Self::command(model_dir, args, env), Duration::from_secs(60))
    }

    /// The command `start` runs, for a test that adds to it before `spawn` (a driver's
    /// library path, say).
    pub fn command<I, S>(model_dir: &Path, args: I, env: &[(&str, &str)]) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new(env!("CARGO_BIN_EXE_celer"));
        command
            .args(["serve", "--model-dir"])
            .arg(model_dir)
            .args(["--bind", "127.0.0.1", "--port", "0"])
            .args(args)
            .env("CELER_LOG", "info,ort=warn")
            // No gRPC unless a test asks for it (`--grpc-port PORT`, or the variable in
            // `env`): tests run side by side, and the default port is one port.
            .env("CELER_GRPC_PORT", "0")
            // FP32 unless a test asks for variants (CELER_FP32=0 in `env`): the tests
            // compare FP32 paths with each other and with the reference, and a variant
            // `make int8` left in onnx/u2netp must not change what they serve.
            .env("CELER_FP32", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for var in [
            "SAGEMAKER_BATCH",
            "SAGEMAKER_MAX_PAYLOAD_IN_MB",
            "SAGEMAKER_BATCH_STRATEGY",
            "SAGEMAKER_MAX_CONCURRENT_TRANSFORMS",
            "SAGEMAKER_MODEL_SERVER_WORKERS",
            "SAGEMAKER_MODEL_SERVER_TIMEOUT",
            "SAGEMAKER_BIND_TO_PORT",
            "CELER_HOSTING",
            "CELER_MAX_BODY_BYTES",
            "CELER_MAX_RESPONSE_BYTES",
        ] {
            command.env_remove(var);
        }
        command.envs(env.iter().copied());
        command
    }

    /// Runs `command` (a `celer serve` on port 0 that logs to stderr) and waits until it
    /// listens and `/ping` answers 200, each within `ready_within`.
    pub fn spawn(mut command: Command, ready_within: Duration) -> Server {
        let mut child = command.spawn().expect("celer serve starts");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (found, address) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = listening_address(&line) {
                    let _ = found.send(at);
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let mut server = Server {
            child: Some(child),
            address: SocketAddr::from(([127, 0, 0, 1], 0)),
            log,
        };
        let started = Instant::now();
        let address = loop {
            match address.recv_timeout(Duration::from_millis(100)) {
                Ok(a) => break a,
                Err(_) => {
                    if let Some(status) = server.exited() {
                        panic!("celer serve exited with {status}:\n{}", server.log());
                    }
                    assert!(
                        started.elapsed() < ready_within,
                        "celer serve did not listen within {ready_within:?}:\n{}",
                        server.log()
                    );
                }
            }
        };
        server.address = address
            .parse()
            .unwrap_or_else(|e| panic!("address {address}: {e}\n{}", server.log()));
        loop {
            if let Some(status) = server.exited() {
                panic!("celer serve exited with {status}:\n{}", server.log());
            }
            if server.get("/ping").0 == 200 {
                break;
            }
            assert!(
                started.elapsed() < ready_within,
                "/ping did not answer 200 within {ready_within:?}:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// The server's process id (the same after `celer serve` re-executes itself).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }

    /// `host:port`, as the Python clients take it.
    pub fn host_port(&self) -> String {
        self.address.to_string()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The log, readable after `stop` consumed the server: what it said while stopping.
    /// Waits until the server's log holds `text`; fails, with the log, after `within`.
    pub fn wait_for_log(&self, text: &str, within: Duration) {
        let started = Instant::now();
        while !self.log().contains(text) {
            assert!(
                started.elapsed() < within,
                "no `{text}` in the log within {within:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_handle(&self) -> impl Fn() -> String {
        let log = self.log.clone();
        move || log.lock().unwrap().clone()
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// `GET path`: status and body.
    pub fn get(&self, path: &str) -> (u16, Vec<u8>) {
        let r = self.request("GET", path, &[], None);
        (r.status, r.body)
    }

    /// `GET path` as JSON (status 200 required).
    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let (status, body) = self.get(path);
        assert_eq!(
            status,
            200,
            "GET {path}: {}\n{}",
            String::from_utf8_lossy(&body),
            self.log()
        );
        serde_json::from_slice(&body)
            .unwrap_or_else(|e| panic!("GET {path}: {e}: {}", String::from_utf8_lossy(&body)))
    }

    /// `POST path` with `headers` and `body` (sent with its length).
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Answer {
        self.request("POST", path, headers, Some(Body::Whole(body)))
    }

    /// One HTTP/1.1 request on its own connection (status 0 when the connection
    /// fails).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Body<'_>>,
    ) -> Answer {
        request(self.address, method, path, headers, body)
    }

    /// Sends `head` as it is (a request the server should answer from its headers
    /// alone) and reads the answer: status and body.
    pub fn raw(&self, head: &str) -> (u16, Vec<u8>) {
        let Ok(mut stream) = TcpStream::connect(self.address) else {
            return (0, Vec::new());
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        if stream.write_all(head.as_bytes()).is_err() {
            return (0, Vec::new());
        }
        let a = read_answer(&mut stream);
        (a.status, a.body)
    }

    /// SIGTERM; the test fails, with the exit status and the log, unless celer exits 0.
    pub fn stop_cleanly(self) {
        let log = self.log_handle();
        let status = self.stop();
        assert!(
            status.success(),
            "exit status after SIGTERM: {status}\n{}",
            log()
        );
    }

    /// SIGTERM, then waits for the exit (at most 30 s, as SageMaker).
    pub fn stop(self) -> ExitStatus {
        self.terminate();
        self.wait()
    }

    /// SIGTERM, without waiting: the server drains, or stops.
    pub fn terminate(&self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
    }

    /// Waits for the exit (at most 30 s, as SageMaker after SIGTERM).
    pub fn wait(self) -> ExitStatus {
        self.wait_within(Duration::from_secs(30))
    }

    /// Waits for the exit, at most `limit` (then kills it and fails, with the log).
    pub fn wait_within(mut self, limit: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status;
            }
            if started.elapsed() > limit {
                let _ = child.kill();
                panic!("celer serve did not exit within {limit:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A request body: whole (with `Content-Length`) or in chunks of this many bytes
/// (`Transfer-Encoding: chunked`).
#[derive(Clone, Copy)]
pub enum Body<'a> {
    Whole(&'a [u8]),
    Chunked(&'a [u8], usize),
}

/// An HTTP answer.
#[derive(Debug, Default)]
pub struct Answer {
    /// 0 when the connection failed.
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{} not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// One HTTP/1.1 request to `address` on its own connection.
pub fn request(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Body<'_>>,
) -> Answer {
    let Ok(mut stream) = TcpStream::connect(address) else {
        return Answer::default();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(600)));
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match body {
        None => head.push_str("\r\n"),
        Some(Body::Whole(b)) => head.push_str(&format!("Content-Length: {}\r\n\r\n", b.len())),
        Some(Body::Chunked(..)) => head.push_str("Transfer-Encoding: chunked\r\n\r\n"),
    }
    let sent = (|| -> std::io::Result<()> {
        stream.write_all(head.as_bytes())?;
        match body {
            None => {}
            Some(Body::Whole(b)) => stream.write_all(b)?,
            Some(Body::Chunked(b, size)) => {
                for chunk in b.chunks(size.max(1)) {
                    stream.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())?;
                    stream.write_all(chunk)?;
                    stream.write_all(b"\r\n")?;
                }
                stream.write_all(b"0\r\n\r\n")?;
            }
        }
        stream.flush()
    })();
    // A server that refuses early may close while the body is still being sent: its
    // answer is still there to read.
    let answer = read_answer(&mut stream);
    if answer.status == 0 {
        if let Err(e) = sent {
            return Answer {
                body: e.to_string().into_bytes(),
                ..Answer::default()
            };
        }
    }
    answer
}

/// A request the server has begun: its handler asked for the body (`Expect:
/// 100-continue` answered `100 Continue`), and the body has been sent. From then on it is
/// in flight, exactly: a drain must answer it. `finish` reads the final answer.
pub struct Begun {
    stream: TcpStream,
}

impl Begun {
    /// POSTs `body` to `path` on a connection of its own; `None` when the server did not
    /// ask for the body (closed, or answered at once: that answer is not waited for).
    pub fn post(address: SocketAddr, path: &str, content_type: &str, body: &[u8]) -> Option<Begun> {
        let mut stream = TcpStream::connect(address).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(600)))
            .ok()?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
             Content-Type: {content_type}\r\nContent-Length: {}\r\n\
             Expect: 100-continue\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).ok()?;
        // The interim answer, a byte at a time so that nothing after it is consumed.
        let mut interim = Vec::new();
        let mut byte = [0u8];
        while !interim.ends_with(b"\r\n\r\n") {
            stream.read_exact(&mut byte).ok()?;
            interim.push(byte[0]);
        }
        if !interim.starts_with(b"HTTP/1.1 100") {
            return None;
        }
        stream.write_all(body).ok()?;
        stream.flush().ok()?;
        Some(Begun { stream })
    }

    pub fn finish(mut self) -> Answer {
        read_answer(&mut self.stream)
    }
}

/// Reads one answer until the server closes (`Connection: close`), decoding a chunked
/// body.
fn read_answer(stream: &mut TcpStream) -> Answer {
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Answer::default();
    };
    let head = String::from_utf8_lossy(&raw[..at]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[at + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(
                String::from_utf8_lossy(&rest[..eol])
                    .split(';')
                    .next()
                    .unwrap_or("")
                    .trim(),
                16,
            )
            .unwrap_or(0);
            if size == 0 || rest.len() < eol + 2 + size {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[(eol + 4 + size).min(rest.len())..];
        }
        body = out;
    }
    Answer {
        status,
        headers,
        body,
    }
}

/// POSTs `photo` to /invocations: the status and, on 200, the decoded cut-out.
pub fn cutout(server: &Server, photo: &Path) -> (u16, Option<RgbaImage>) {
    let body = std::fs::read(photo).expect("the photo");
    let kind = if photo.extension().is_some_and(|e| e == "png") {
        "image/png"
    } else {
        "image/jpeg"
    };
    let answer = server.post("/invocations", &[("Content-Type", kind)], &body);
    let image = (answer.status == 200).then(|| {
        image::load_from_memory(&answer.body)
            .expect("a PNG cut-out")
            .into_rgba8()
    });
    (answer.status, image)
}

/// The largest difference of any channel of two cut-outs of the same size.
pub fn max_difference(a: &RgbaImage, b: &RgbaImage) -> u8 {
    assert_eq!(a.dimensions(), b.dimensions());
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}
