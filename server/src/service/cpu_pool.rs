//! The bounded pool for CPU-heavy requests: Decide, Balance, topology builds
//! (Register, hotplug) and cache reads.
//!
//! A PickCpu costs microseconds; a Decide of a large topology or a balance
//! pass over thousands of tasks costs milliseconds or more. Counting both the
//! same way lets a few heavy callers take every runtime worker and starve the
//! cheap calls, so heavy work is admitted by its own limit and runs off the
//! async workers:
//! - at most `workers` heavy jobs run at once (by default one core fewer than
//!   the machine has, so one core always serves the cheap calls), each on a
//!   blocking thread at nice 10, so a waking worker thread preempts it;
//! - at most `queue` more wait; beyond that a heavy call is refused at once
//!   with RESOURCE_EXHAUSTED instead of queueing behind work it cannot beat;
//! - a waiting or running job holds its permits until its work returns, even
//!   when the caller's deadline (tonic's timeout) dropped the request, so the
//!   limit always counts the CPU really in use.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Semaphore;
use tonic::Status;

use crate::metrics as m;

/// Admission and concurrency limits for heavy work; cheap to clone.
#[derive(Clone)]
pub struct CpuPool {
    /// Running plus waiting jobs.
    admitted: Arc<Semaphore>,
    /// Running jobs.
    running: Arc<Semaphore>,
}

/// The default number of heavy jobs running at once: all but one CPU.
pub fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .max(1)
}

impl CpuPool {
    pub fn new(workers: usize, queue: usize) -> Self {
        let workers = workers.max(1);
        Self {
            admitted: Arc::new(Semaphore::new(workers + queue)),
            running: Arc::new(Semaphore::new(workers)),
        }
    }

    /// Runs `f` on a blocking thread once a slot is free; refuses at once
    /// when the pool and its queue are full. `what` names the work in the
    /// refusal and in the shed counter.
    pub async fn run<T, F>(&self, what: &'static str, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let Ok(admitted) = Arc::clone(&self.admitted).try_acquire_owned() else {
            metrics::counter!(m::RPC_SHED, "limit" => what).increment(1);
            return Err(Status::resource_exhausted(format!(
                "server busy: the limit of concurrent {what} work is reached, retry later"
            )));
        };
        let running = Arc::clone(&self.running)
            .acquire_owned()
            .await
            .map_err(|_| Status::unavailable("server shutting down"))?;
        let job = tokio::task::spawn_blocking(move || {
            lower_priority();
            let out = f();
            drop((running, admitted));
            out
        });
        job.await
            .map_err(|e| Status::internal(format!("{what}: the worker failed: {e}")))
    }
}

thread_local! {
    static NICED: AtomicBool = const { AtomicBool::new(false) };
}

/// Nice 10 for this blocking thread (Linux nice values are per thread), once.
/// Heavy work then yields the CPU to the runtime workers that answer the
/// cheap calls; a thread the pool later reuses keeps the lower priority,
/// which is right: only heavy work runs on blocking threads here.
fn lower_priority() {
    NICED.with(|n| {
        if !n.swap(true, Ordering::Relaxed) {
            #[cfg(target_os = "linux")]
            // SAFETY: setpriority with who = 0 changes only the calling
            // thread's nice value; failure leaves it unchanged.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_pool_refuses_at_once_and_frees_its_slot_when_work_returns() {
        // One worker, no queue.
        let pool = CpuPool::new(1, 0);
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let p = pool.clone();
        let held = tokio::spawn(async move { p.run("decide", move || wait.recv().is_ok()).await });
        // Let the first job take the only slot.
        while pool.admitted.available_permits() != 0 {
            tokio::task::yield_now().await;
        }
        let refused = pool.run("decide", || ()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(
            refused.message().contains("decide"),
            "{}",
            refused.message()
        );
        release.send(()).unwrap();
        assert!(held.await.unwrap().unwrap());
        // The slot is free again.
        assert_eq!(pool.run("decide", || 7).await.unwrap(), 7);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_work_waits_for_a_worker_instead_of_being_refused() {
        let pool = CpuPool::new(1, 4);
        let jobs: Vec<_> = (0..5)
            .map(|i| {
                let p = pool.clone();
                tokio::spawn(async move {
                    p.run("balance", move || {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        i
                    })
                    .await
                })
            })
            .collect();
        let mut got = vec![];
        for j in jobs {
            got.push(j.await.unwrap().unwrap());
        }
        got.sort();
        assert_eq!(got, [0, 1, 2, 3, 4]);
    }
}
