//! `celer serve`: start the devices' replicas behind the router, listen, answer until
//! SIGTERM or Ctrl-C, then drain in-flight requests within the grace period.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::watch;

use super::args::ServeArgs;
use crate::config::ServerConfig;
use crate::host::cpus::CpuBudget;
use crate::host::priority;
use crate::http::grpc::GrpcLimits;
use crate::http::{routes, AppState, FrontEnd, Hosting, ServedModel, UrlFetcher};
use crate::sched::{Readiness, Scheduler};

/// The exit status of a server that stopped because a GPU was lost where it cannot come
/// back in this process (TensorRT's state in its lost context, or a replica stuck on a hung
/// GPU): sysexits' EX_TEMPFAIL, a failure that a restart is expected to clear. The platform
/// (SageMaker, Kubernetes) restarts a container whose process exits (docs/gpu.md).
pub const RESTART_EXIT_STATUS: u8 = 75;

/// Why a server stopped for its process to be restarted: a GPU lost for good (`device: why`).
#[derive(Debug, thiserror::Error)]
#[error("{0}; the server drained and exits with status {RESTART_EXIT_STATUS} for the platform to restart it (a new process can use the GPU again)")]
pub struct MustRestart(pub String);

/// How the binary gives freed heap back to the system (src/main.rs); none in tests.
static HEAP_TRIM: OnceLock<fn()> = OnceLock::new();

/// Sets what `serve` calls when the server goes idle after work (once).
pub fn set_heap_trim(trim: fn()) {
    let _ = HEAP_TRIM.set(trim);
}

/// How long the server stays idle (nothing admitted, nothing in flight) before it gives
/// memory back. A lone client's next request within this finds the block cache as the
/// last run left it; given back, the next model run maps and faults its activations
/// afresh. Given back at the first idle moment instead, a client that takes turns with
/// another server paid that on every request (docs/decisions.md, "The block cache"). A
/// burst's memory still goes back within 5 s of its end.
const IDLE_BEFORE_TRIM: Duration = Duration::from_secs(3);

/// When to give memory back: after `IDLE_BEFORE_TRIM` without a request, once per spell
/// of work, so that nothing is given back under load (the next run would fault the pages
/// in again) and what a burst allocated goes back to the system after it.
#[derive(Debug)]
struct IdleTrim {
    busy: bool,
    admitted: u64,
    last_active: Instant,
}

impl IdleTrim {
    fn new(admitted: u64, now: Instant) -> Self {
        Self {
            busy: false,
            admitted,
            last_active: now,
        }
    }

    /// A look at the server at `now`: whether to give memory back now.
    fn tick(&mut self, now: Instant, in_flight: usize, admitted: u64) -> bool {
        if in_flight > 0 || admitted != self.admitted {
            self.busy = true;
            self.admitted = admitted;
            self.last_active = now;
            false
        } else if self.busy && now.duration_since(self.last_active) >= IDLE_BEFORE_TRIM {
            self.busy = false;
            true
        } else {
            false
        }
    }
}

/// Gives memory back when the server has gone idle after being busy (`IdleTrim`): the
/// block cache, the pixel blocks kept for reuse, then the heap trim.
async fn trim_when_idle(state: Arc<AppState>) {
    let mut idle = IdleTrim::new(state.scheduler.admitted(), Instant::now());
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let (in_flight, admitted) = (state.scheduler.in_flight(), state.scheduler.admitted());
        if idle.tick(Instant::now(), in_flight, admitted) {
            let pixels = state.pixels.clone();
            let _ = tokio::task::spawn_blocking(move || {
                crate::ort::allocator::release_cached();
                pixels.release_kept();
                crate::replica::cpu::release_kept_buffers();
                if let Some(&heap_trim) = HEAP_TRIM.get() {
                    heap_trim();
                }
            })
            .await;
        }
    }
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // The runtime's worker threads (connections, routing, refusals) yield contended cores
    // to the replicas and to the request path's CPU work (`AppState::work`), which keep
    // the priority of this thread; see `host::priority`. Lowered on their first wake-up:
    // only worker threads wake up from a park, not the blocking pool's.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_unpark(lower_runtime_thread)
        .build()
        .context("starting the async runtime")?;
    // Caught from the first moment, before any device loads: NVRTC 12 puts handlers of its
    // own on SIGINT and SIGTERM while it compiles and then restores the ones it found, so
    // a handler installed during a compile (at start-up, on a replica's thread) was undone
    // and SIGTERM killed celer instead of draining it.
    let signals = {
        let _entered = runtime.enter();
        StopSignals::register().context("catching SIGTERM and SIGINT")?
    };
    let config = super::resolve::resolve(&args, |name| std::env::var(name).ok())?;
    tracing::info!(cores = %CpuBudget::get().describe(), "{config}");
    for note in &config.hosting.notes {
        tracing::warn!("{note}");
    }
    let spec = super::load_pipeline(&config.model_dir)?;
    // Fail before listening when ONNX Runtime cannot load: the message says how to fix it.
    crate::ort::session::environment()?;
    let super::devices::ServingDevices {
        setups,
        pixels,
        precisions,
    } = super::devices::device_setups(
        &spec,
        &config.model_dir,
        &config.replicas,
        &config.devices,
        config.requests.decode.max_pixels,
    )?;
    let names: Vec<String> = setups
        .iter()
        .map(|d| format!("{} x{}", d.name, d.replicas))
        .collect();
    tracing::info!(
        pipeline = %spec.source.display(),
        devices = %names.join(", "),
        max_batch = spec.batching.max_batch,
        "starting the devices"
    );
    let scheduler = Scheduler::start(setups, config.scheduler.clone());
    let front = FrontEnd {
        limits: config.requests.clone(),
        default_output: spec.default_output,
        fetcher: UrlFetcher::new(
            &config.fetch.allow_hosts,
            config.fetch.timeout,
            config.hosting.max_body_bytes,
        ),
        server_timing: config.server_timing,
        hosting: Hosting::from_plan(&config.hosting, scheduler.admission_limit()),
        model: ServedModel {
            name: config.model_name.clone(),
            max_batch: spec.batching.max_batch,
            max_wait_us: spec.batching.max_wait_us,
        },
        pixels,
        tracer: config.trace.clone().map(|t| {
            let _entered = runtime.enter();
            crate::trace::Tracer::start(t)
        }),
        ready_while_building: config.devices.ready_while_building,
        model_precision: precisions
            .into_iter()
            .map(|(device, precision)| (device.to_string(), precision))
            .collect(),
    };
    let state = Arc::new(AppState::new(scheduler, front));
    runtime.block_on(run_server(&config, state, signals))
}

/// Lowers a runtime worker thread's priority, once; a failure is logged once and leaves
/// the thread as it was.
fn lower_runtime_thread() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if let Err(e) = priority::lower_this_thread_once(priority::RUNTIME_NICE_STEP) {
        WARNED.call_once(|| {
            tracing::warn!(error = %e, "cannot lower the HTTP runtime's priority: refusals under a flood share the cores with the replicas")
        });
    }
}

/// SIGTERM (SageMaker's and Kubernetes' stop) and SIGINT (Ctrl-C), registered with the
/// runtime as soon as it exists.
struct StopSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers now; needs the runtime entered.
    fn register() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// The first of them to arrive.
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

async fn run_server(
    config: &ServerConfig,
    state: Arc<AppState>,
    signals: StopSignals,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((config.bind.as_str(), config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.bind, config.port))?;
    tracing::info!(address = %listener.local_addr()?, "listening");

    // `true` once shutdown has begun, whoever began it.
    let stop = Arc::new(watch::channel(false).0);
    let load_failure = tokio::spawn(watch_loading(state.clone(), stop.clone()));
    let lost_gpu = tokio::spawn(watch_lost_gpus(state.clone(), stop.clone(), config.drain));
    let trimming = tokio::spawn(trim_when_idle(state.clone()));
    let grace = config.shutdown_grace;
    let draining = {
        let mut stopping = stop.subscribe();
        async move {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        }
    };
    // The gRPC port is bound before serving starts, so that a port in use fails the start
    // as the REST port does; it stops accepting when the REST port does.
    let grpc = match config.grpc_port {
        Some(port) => {
            let listener = tokio::net::TcpListener::bind((config.bind.as_str(), port))
                .await
                .with_context(|| {
                    format!(
                        "cannot listen for gRPC on {}:{port} (--grpc-port; 0 turns gRPC off)",
                        config.bind
                    )
                })?;
            // Not "listening": that line names the REST port, which tools wait for.
            tracing::info!(grpc_address = %listener.local_addr()?, "serving gRPC");
            let limits = GrpcLimits::from_rest(
                &config.connections,
                &config.requests,
                state.scheduler.admission_limit(),
            );
            let mut stopping = stop.subscribe();
            let stopped = async move {
                let _ = stopping.wait_for(|s| *s).await;
            };
            Some(tokio::spawn(crate::http::grpc::serve(
                listener,
                state.clone(),
                limits,
                stopped,
            )))
        }
        None => None,
    };
    let server = crate::http::server::serve(
        listener,
        routes(state.clone()),
        config.connections,
        shutdown_signal(
            signals,
            stop,
            Drain {
                state: state.clone(),
                for_: config.drain,
            },
        ),
    );
    let grpc_done = async move {
        match grpc {
            Some(task) => match task.await {
                Ok(result) => result.context("serving gRPC"),
                Err(e) => Err(anyhow::anyhow!("the gRPC server failed: {e}")),
            },
            None => Ok(()),
        }
    };
    let both = async { tokio::try_join!(async { server.await.context("serving") }, grpc_done) };
    tokio::select! {
        result = both => { result?; }
        () = draining => tracing::warn!(grace_s = grace.as_secs(), "in-flight requests did not finish in the grace period"),
    }
    if let Some(tracer) = &state.tracer {
        // The last requests' spans, within what is left of SageMaker's 30 s.
        tracer.shutdown(Duration::from_secs(3)).await;
    }
    trimming.abort();
    if lost_gpu.is_finished() {
        if let Ok(Some(why)) = lost_gpu.await {
            let stopped = MustRestart(why);
            tracing::error!(exit_status = RESTART_EXIT_STATUS, "stopped: {stopped}");
            return Err(stopped.into());
        }
    } else {
        lost_gpu.abort();
    }
    match load_failure.await {
        Ok(Some(e)) => Err(anyhow::anyhow!("the models failed to load: {e}")),
        _ => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// Waits for a device lost for good (`Scheduler::lost_for_good`); then drains as after
/// SIGTERM (readiness 503 for `drain` while the other devices still serve, so that the
/// load balancer stops sending here), stops the server (in-flight requests get the shutdown
/// grace) and returns why, for the process to exit with `RESTART_EXIT_STATUS`.
async fn watch_lost_gpus(
    state: Arc<AppState>,
    stop: Arc<watch::Sender<bool>>,
    drain: Duration,
) -> Option<String> {
    let mut stopping = stop.subscribe();
    let why = loop {
        if let Some(why) = state.scheduler.lost_for_good() {
            break why;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = stopping.wait_for(|s| *s) => return None,
        }
    };
    state.start_draining();
    tracing::error!(
        error = %why,
        drain_s = drain.as_secs(),
        exit_status = RESTART_EXIT_STATUS,
        "a GPU is lost for good: draining (readiness answers 503, the other devices serve), then \
         exiting for the platform to restart the process"
    );
    tokio::select! {
        () = tokio::time::sleep(drain) => {}
        _ = stopping.wait_for(|s| *s) => {}
    }
    stop.send_replace(true);
    Some(why)
}

/// Logs when the CPU serves while the GPUs load, and when every replica is ready; on a
/// load failure stops the server and returns it.
async fn watch_loading(state: Arc<AppState>, stop: Arc<watch::Sender<bool>>) -> Option<String> {
    let mut said_interim = false;
    loop {
        match state.scheduler.readiness() {
            Readiness::Interim { loaded, of } if !said_interim => {
                said_interim = true;
                tracing::info!(
                    gpu_replicas_loaded = loaded,
                    gpu_replicas = of,
                    "serving on the CPU while the GPUs load: requests move to each GPU as its \
                     engines load; /ping answers {}",
                    if state.ready_while_building {
                        "200 from now (--ready-while-building)"
                    } else {
                        "503 until they have (--ready-while-building: 200 from now)"
                    }
                );
            }
            Readiness::Ready => {
                let devices: Vec<String> = state
                    .scheduler
                    .devices()
                    .iter()
                    .map(|d| format!("{} x{}", d.name, d.replicas))
                    .collect();
                tracing::info!(devices = %devices.join(", "), "ready: /ping answers 200");
                return None;
            }
            Readiness::Failed(e) => {
                stop.send_replace(true);
                return Some(e);
            }
            Readiness::Loading { .. } | Readiness::Interim { .. } => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
        }
    }
}

/// What happens between SIGTERM and closing the listener: `for_` of serving while
/// readiness answers 503, so that the load balancer (Kubernetes' endpoints, SageMaker's
/// router) stops sending requests here before they could be refused.
struct Drain {
    state: Arc<AppState>,
    for_: Duration,
}

/// Resolves on SIGTERM or Ctrl-C after the drain, or at once on an internal stop or a
/// second signal during the drain; then starts the grace timer.
async fn shutdown_signal(mut signals: StopSignals, stop: Arc<watch::Sender<bool>>, drain: Drain) {
    let mut stopping = stop.subscribe();
    let stopped = async move {
        let _ = stopping.wait_for(|s| *s).await;
    };
    tokio::pin!(stopped);
    let signalled = tokio::select! {
        () = signals.recv() => true,
        () = &mut stopped => false,
    };
    if signalled && !drain.for_.is_zero() {
        drain.state.start_draining();
        tracing::info!(
            drain_s = drain.for_.as_secs(),
            "draining: still serving, readiness answers 503"
        );
        tokio::select! {
            () = tokio::time::sleep(drain.for_) => {}
            () = signals.recv() => tracing::info!("a second stop signal: the drain is cut short"),
            () = &mut stopped => {}
        }
    }
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
    stop.send_replace(true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_goes_back_after_a_quiet_spell_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut idle = IdleTrim::new(0, t0);
        // Never busy: nothing to give back.
        assert!(!idle.tick(at(5_000), 0, 0));
        // A client taking turns with another server: a request admitted and answered
        // between two looks, then 0.4 s idle, again and again. Never given back.
        for k in 1..=10u64 {
            assert!(!idle.tick(at(5_000 + 500 * k), 0, k), "turn {k}");
        }
        // One in flight at a look, then quiet: given back 3 s after the last activity
        // seen, once.
        assert!(!idle.tick(at(11_000), 1, 11));
        assert!(!idle.tick(at(13_500), 0, 11));
        assert!(idle.tick(at(14_000), 0, 11));
        assert!(!idle.tick(at(20_000), 0, 11));
        // Busy again, then quiet again: given back again.
        assert!(!idle.tick(at(20_500), 0, 12));
        assert!(idle.tick(at(23_500), 0, 12));
    }
}
