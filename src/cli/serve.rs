//! `celer serve`: start the devices' replicas behind the router, listen, answer until
//! SIGTERM or Ctrl-C, then drain in-flight requests within the grace period.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::config::cpus::CpuBudget;
use crate::config::ServeArgs;
use crate::http::{routes, AppState, Hosting, ServedModel, UrlFetcher};
use crate::sched::{Readiness, Router};

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
    let mut router_config = args.router_config();
    // A transform job's own concurrency is admitted at once, never refused.
    router_config.queue_capacity = plan.queue_capacity(router_config.queue_capacity);
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
    let grace = Duration::from_secs(args.shutdown_grace_s);
    let draining = {
        let mut stopping = stop.subscribe();
        async move {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        }
    };
    let server = axum::serve(listener, routes(state)).with_graceful_shutdown(shutdown_signal(stop));
    tokio::select! {
        result = server => result.context("serving")?,
        () = draining => tracing::warn!(grace_s = grace.as_secs(), "in-flight requests did not finish in the grace period"),
    }
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
