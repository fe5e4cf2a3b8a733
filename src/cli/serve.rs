//! `celer serve`: start the devices' replicas behind the router, listen, answer until
//! SIGTERM or Ctrl-C, then drain in-flight requests within the grace period.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::config::cpus::CpuBudget;
use crate::config::ServeArgs;
use crate::http::{routes, AppState, Hosting, ServedModel, UrlFetcher};
use crate::sched::{Readiness, Router};

/// How the binary gives freed heap back to the system (src/main.rs); none in tests.
static HEAP_TRIM: OnceLock<fn()> = OnceLock::new();

/// Sets what `serve` calls when the server goes idle after work (once).
pub fn set_heap_trim(trim: fn()) {
    let _ = HEAP_TRIM.set(trim);
}

/// Gives memory back when the server has gone idle (nothing in flight) after being busy:
/// the block cache, then the heap trim, so what a burst allocated goes
/// back to the system, and nothing is given back under load (the next run would fault
/// the pages in again).
async fn trim_when_idle(state: Arc<AppState>) {
    fn trim() {
        crate::backend::ort_allocator::release_cached();
        if let Some(&heap_trim) = HEAP_TRIM.get() {
            heap_trim();
        }
    }
    let mut busy = false;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        if state.router.in_flight() > 0 {
            busy = true;
        } else if busy {
            busy = false;
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

pub fn serve(mut args: ServeArgs) -> anyhow::Result<()> {
    let plan = args.hosting_plan().map_err(anyhow::Error::msg)?;
    tracing::info!(cores = %CpuBudget::get().describe(), "{}", plan.describe());
    for note in &plan.notes {
        tracing::warn!("{note}");
    }
    args.runtime.replicas = plan.replicas;
    let spec = super::load_pipeline(&args.runtime.model_dir)?;
    // Fail before listening when ONNX Runtime cannot load: the message says how to fix it.
    crate::backend::ort::environment()?;
    let setups =
        super::devices::device_setups(&spec, &args.runtime, &args.device, args.max_pixels)?;
    let names: Vec<String> = setups
        .iter()
        .map(|d| format!("{} x{}", d.name, d.replicas))
        .collect();
    tracing::info!(
        pipeline = %spec.source.display(),
        devices = %names.join(", "),
        routing = %args.routing,
        max_batch = spec.batching.max_batch,
        "starting the devices"
    );
    let router_config = args.router_config(&plan);
    let admission_limit = router_config.max_in_flight.unwrap_or_else(|| {
        setups
            .iter()
            .map(|d| d.replicas.max(1) + router_config.queue_capacity.max(1))
            .sum()
    });
    let pipeline_router = Router::start(setups, router_config);
    let fetcher = UrlFetcher::new(
        &args.fetch_allow_hosts,
        Duration::from_millis(args.fetch_timeout_ms),
        plan.max_body_bytes,
    );
    let mut state = AppState::new(
        pipeline_router,
        args.limits(&plan),
        spec.default_output,
        fetcher,
        args.server_timing,
    );
    state.hosting = Hosting::from_plan(&plan, admission_limit);
    state.model = ServedModel {
        name: args.model_name.clone(),
        max_batch: spec.batching.max_batch,
        max_wait_us: spec.batching.max_wait_us,
    };
    let state = Arc::new(state);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_server(args, state))
}

async fn run_server(args: ServeArgs, state: Arc<AppState>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((args.bind.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.bind, args.port))?;
    tracing::info!(address = %listener.local_addr()?, "listening");

    // `true` once shutdown has begun, whoever began it.
    let stop = Arc::new(watch::channel(false).0);
    let load_failure = tokio::spawn(watch_loading(state.clone(), stop.clone()));
    let trimming = tokio::spawn(trim_when_idle(state.clone()));
    let grace = Duration::from_secs(args.shutdown_grace_s);
    let draining = {
        let mut stopping = stop.subscribe();
        async move {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        }
    };
    // The hosting mode's largest body must fit the limits on bodies in transit.
    let conn_limits = args
        .conn
        .limits()
        .fit_to_bodies(state.limits.max_body_bytes, state.limits.deadline);
    let server =
        crate::http::server::serve(listener, routes(state), conn_limits, shutdown_signal(stop));
    tokio::select! {
        result = server => result.context("serving")?,
        () = draining => tracing::warn!(grace_s = grace.as_secs(), "in-flight requests did not finish in the grace period"),
    }
    trimming.abort();
    match load_failure.await {
        Ok(Some(e)) => Err(anyhow::anyhow!("the models failed to load: {e}")),
        _ => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// Logs when every replica is ready; on a load failure stops the server and returns it.
async fn watch_loading(state: Arc<AppState>, stop: Arc<watch::Sender<bool>>) -> Option<String> {
    loop {
        match state.router.readiness() {
            Readiness::Ready => {
                let devices: Vec<String> = state
                    .router
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
            Readiness::Loading { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Resolves on SIGTERM, Ctrl-C, or an internal stop; starts the grace timer.
async fn shutdown_signal(stop: Arc<watch::Sender<bool>>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    let mut stopping = stop.subscribe();
    let stopped = async move {
        let _ = stopping.wait_for(|s| *s).await;
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
        () = stopped => {}
    }
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
    stop.send_replace(true);
}
