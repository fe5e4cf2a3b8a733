//! Per-device workers: R replicas of the pipeline, each on its own OS thread with its own
//! sessions, fed from one bounded queue (any idle replica takes the next request).
//! Admission is `try_send`: a full queue is an immediate `Overloaded`, never a wait.
//! Model and ONNX Runtime calls never run on the async executor.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use image::RgbImage;
use tokio::sync::oneshot;

use crate::config::PipelineSpec;
use crate::pipeline::{Matte, Pipeline, PipelineError, StageTimings};

/// A place among the requests this pool holds (queued or running), taken before any work
/// is done for the request (reading, decoding) so that an overloaded server refuses at
/// once instead of decoding images it will not run. Freed when dropped.
#[derive(Debug)]
pub struct Admission {
    held: Arc<AtomicUsize>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.held.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request for the device stages of one image.
struct Job {
    _admission: Admission,
    image: Arc<RgbImage>,
    enqueued: Instant,
    deadline: Instant,
    timings: StageTimings,
    reply: oneshot::Sender<Result<Done, JobError>>,
}

/// A finished job: the matte, the stage times so far, and how long it queued.
#[derive(Debug)]
pub struct Done {
    pub matte: Matte,
    pub timings: StageTimings,
    pub queued: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("all {capacity} queue slots are taken")]
    Overloaded { capacity: usize },
    #[error("the workers have stopped")]
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("the request's deadline passed before a replica was free")]
    DeadlineExceeded,
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("the replica failed unexpectedly: {0}")]
    Panicked(String),
}

/// The state of the replicas' model loading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Loading { loaded: usize, of: usize },
    Ready,
    Failed(String),
}

pub struct WorkerPool {
    queue: Sender<Job>,
    capacity: usize,
    /// Requests admitted and not yet finished; at most `capacity + replicas`.
    admitted: Arc<AtomicUsize>,
    replicas: usize,
    loaded: Arc<AtomicUsize>,
    load_error: Arc<Mutex<Option<String>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl WorkerPool {
    /// Starts `replicas` threads that each load `spec` (with `intra_threads` ONNX
    /// Runtime threads) and then serve the queue. Returns at once: see `readiness`.
    pub fn start(
        spec: &PipelineSpec,
        replicas: usize,
        intra_threads: usize,
        queue_capacity: usize,
    ) -> Self {
        let (queue, jobs) = crossbeam_channel::bounded(queue_capacity);
        let loaded = Arc::new(AtomicUsize::new(0));
        let load_error = Arc::new(Mutex::new(None));
        let threads = (0..replicas)
            .map(|index| {
                let (spec, jobs) = (spec.clone(), jobs.clone());
                let (loaded, load_error) = (loaded.clone(), load_error.clone());
                std::thread::Builder::new()
                    .name(format!("celer-cpu-{index}"))
                    .spawn(move || match Pipeline::load(&spec, intra_threads) {
                        Ok(pipeline) => {
                            loaded.fetch_add(1, Ordering::SeqCst);
                            tracing::info!(replica = index, "replica ready");
                            serve_queue(pipeline, &jobs);
                        }
                        Err(e) => {
                            tracing::error!(replica = index, error = %e, "replica failed to load");
                            let mut slot = load_error.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e.to_string());
                        }
                    })
                    .expect("spawning a replica thread")
            })
            .collect();
        Self {
            queue,
            capacity: queue_capacity,
            admitted: Arc::new(AtomicUsize::new(0)),
            replicas,
            loaded,
            load_error,
            threads: Mutex::new(threads),
        }
    }

    pub fn replicas(&self) -> usize {
        self.replicas
    }

    pub fn readiness(&self) -> Readiness {
        if let Some(e) = self
            .load_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Readiness::Failed(e);
        }
        match self.loaded.load(Ordering::SeqCst) {
            n if n >= self.replicas => Readiness::Ready,
            n => Readiness::Loading {
                loaded: n,
                of: self.replicas,
            },
        }
    }

    /// Waits (blocking) until every replica has loaded or one has failed.
    pub fn wait_ready(&self) -> Result<(), String> {
        loop {
            match self.readiness() {
                Readiness::Ready => return Ok(()),
                Readiness::Failed(e) => return Err(e),
                Readiness::Loading { .. } => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Takes a place for one request: one per replica plus the queue's capacity. Fails
    /// at once when every place is taken.
    pub fn admit(&self) -> Result<Admission, SubmitError> {
        let limit = self.capacity + self.replicas;
        let before = self.admitted.fetch_add(1, Ordering::SeqCst);
        let admission = Admission {
            held: self.admitted.clone(),
        };
        if before >= limit {
            return Err(SubmitError::Overloaded {
                capacity: self.capacity,
            });
        }
        Ok(admission)
    }

    /// Queues `image` for the device stages. Fails at once when the queue is full.
    pub fn submit(
        &self,
        admission: Admission,
        image: Arc<RgbImage>,
        deadline: Instant,
        timings: StageTimings,
    ) -> Result<oneshot::Receiver<Result<Done, JobError>>, SubmitError> {
        let (reply, receiver) = oneshot::channel();
        let job = Job {
            _admission: admission,
            image,
            enqueued: Instant::now(),
            deadline,
            timings,
            reply,
        };
        match self.queue.try_send(job) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => Err(SubmitError::Overloaded {
                capacity: self.capacity,
            }),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Stopped),
        }
    }

    /// Requests waiting for a replica.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// Closes the queue and waits for the replicas to finish what they hold.
    pub fn shutdown(self) {
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        drop(self.queue);
        for t in threads {
            let _ = t.join();
        }
    }
}

fn serve_queue(mut pipeline: Pipeline, jobs: &Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        // The client went away (its handler was dropped): nothing is waiting.
        if job.reply.is_closed() {
            continue;
        }
        let queued = job.enqueued.elapsed();
        if Instant::now() >= job.deadline {
            let _ = job.reply.send(Err(JobError::DeadlineExceeded));
            continue;
        }
        let mut timings = job.timings;
        // A panic in a stage is a bug, but it must cost one request, not the replica.
        let result =
            std::panic::catch_unwind(AssertUnwindSafe(|| pipeline.run(&job.image, &mut timings)));
        let reply = match result {
            Ok(Ok(matte)) => Ok(Done {
                matte,
                timings,
                queued,
            }),
            Ok(Err(e)) => Err(JobError::Pipeline(e)),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into());
                tracing::error!(error = %what, "pipeline panicked");
                Err(JobError::Panicked(what))
            }
        };
        let _ = job.reply.send(reply);
    }
}
