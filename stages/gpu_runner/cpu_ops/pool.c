/* The GGUF decode path's threads: a job's items are cut into chunks that the calling thread and
 * the pool's workers claim one at a time, and the job is over when every chunk is done, not when
 * every thread has come by.
 *
 * An OpenMP loop ends at a barrier that waits for each of its threads. On a CPU shared with the
 * other stages (and, on a busy machine, with other work), one of them is often preempted or asleep
 * as a product starts, and a decode step is some 150 products of tens of microseconds each. Here a
 * late worker costs nothing: the caller claims the chunks it has not started, and it waits only
 * for a chunk a worker has begun. The worker, when it runs, finds the job over, or the next one.
 * (One stream of SmolLM2 in process beside two busy processes per core: 67-234 ms a token with
 * OpenMP's loops, 59-68 ms here; docs/cpu.md.)
 *
 * Each item is computed by one thread from the same inputs in the same order whoever claims it, so
 * a result does not depend on the number of threads or on who ran what.
 *
 * pool_run uses the pool between pool_enter() and pool_leave() on the calling thread (decoder.c's
 * stack, quant.c's and quant_x8.c's products), and OpenMP's threads (torch's) elsewhere, so that
 * the layer path's kernels and torch's operators keep one team. A job at a time: a second caller
 * (another thread, or a job's own chunk) runs its job inline. The threads are omp_get_max_threads()
 * (which torch.set_num_threads sets): the caller and that many less one workers, started as first
 * needed and inheriting the caller's CPU affinity. Between jobs a worker spins for SPIN_NS, then
 * sleeps until the next one.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_WORKERS 63
#define SPIN_NS 200000    /* a worker's spin after a job: longer than the gaps between a step's products */
#define YIELD_AFTER 2000  /* the caller's spins on a begun chunk before it yields its core to the worker */
#define CHUNKS_PER_THREAD 8

/* The job: its fields are written while no chunk of the last job can still be claimed, and a worker
 * validates what it read by claiming with a compare-and-swap on `state` (generation << 32 | next
 * chunk), which fails once the generation moves on. */
static struct {
    /* each written by one thread and read by the others on a cache line of its own */
    _Alignas(64) _Atomic uint64_t state;
    _Alignas(64) _Atomic int64_t done; /* chunks finished this job */
    _Alignas(64) _Atomic(pool_task) task;
    _Atomic(void *) arg;
    _Atomic int64_t items, grain, chunks;
    _Atomic int helpers; /* workers with an id below it take part in this job */
    _Alignas(64) _Atomic int sleepers;
    pthread_mutex_t busy;  /* held by a job's caller */
    pthread_mutex_t sleep; /* with `wake`: idle workers' sleep */
    pthread_cond_t wake;
    int workers; /* started (the caller's, under `busy`) */
    int atfork;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claims and runs the chunks of generation `s >> 32` until none is left. The fields are read once,
 * after `s`: a claim that succeeds proves they were still that generation's. */
static void help(uint64_t s) {
    const uint64_t generation = s >> 32;
    const pool_task task = atomic_load_explicit(&pool.task, memory_order_relaxed);
    void *arg = atomic_load_explicit(&pool.arg, memory_order_relaxed);
    const int64_t items = atomic_load_explicit(&pool.items, memory_order_relaxed);
    const int64_t grain = atomic_load_explicit(&pool.grain, memory_order_relaxed);
    const int64_t chunks = atomic_load_explicit(&pool.chunks, memory_order_relaxed);
    for (;;) {
        const int64_t next = (int64_t)(uint32_t)s;
        if (next >= chunks) return;
        if (atomic_compare_exchange_weak_explicit(&pool.state, &s, s + 1, memory_order_acq_rel, memory_order_acquire)) {
            const int64_t begin = next * grain, end = begin + grain < items ? begin + grain : items;
            task(arg, begin, end);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            s = atomic_load_explicit(&pool.state, memory_order_acquire);
        }
        if (s >> 32 != generation) return; /* the job is over: another's fields may be in place */
    }
}

static void *worker(void *id_pointer) {
    const int id = (int)(intptr_t)id_pointer;
    uint64_t seen = atomic_load_explicit(&pool.state, memory_order_acquire) >> 32;
    int64_t idle_since = now_ns();
    for (unsigned spins = 0;; spins++) {
        const uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
        if (s >> 32 != seen) {
            seen = s >> 32;
            if (id < atomic_load_explicit(&pool.helpers, memory_order_relaxed)) help(s);
            idle_since = now_ns();
            continue;
        }
        cpu_relax();
        if (spins % 64 != 0 || now_ns() - idle_since < SPIN_NS) continue;
        pthread_mutex_lock(&pool.sleep);
        atomic_fetch_add(&pool.sleepers, 1);
        while (atomic_load(&pool.state) >> 32 == seen) pthread_cond_wait(&pool.wake, &pool.sleep);
        atomic_fetch_sub(&pool.sleepers, 1);
        pthread_mutex_unlock(&pool.sleep);
    }
    return NULL;
}

/* A child of fork has the caller's thread alone: it starts its own workers. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.workers = 0;
}

static int start_workers(int wanted) {
    if (!pool.atfork) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        pool.atfork = 1;
    }
    while (pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigset_t all, old; /* signals stay the caller's: a worker is started with every one blocked */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        const int failed = pthread_create(&thread, &attr, worker, (void *)(intptr_t)pool.workers);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    return pool.workers;
}

static _Thread_local int entered; /* pool_enter()s not yet left on this thread */

void pool_enter(void) { entered++; }
void pool_leave(void) { entered--; }
int pool_entered(void) { return entered > 0; }

/* The chunks on OpenMP's threads (torch's), as an OpenMP loop shares them. */
static void run_on_openmp(pool_task task, void *arg, int64_t items, int64_t grain, int64_t chunks) {
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; c++) task(arg, c * grain, (c + 1) * grain < items ? (c + 1) * grain : items);
}

void pool_run(pool_task task, void *arg, int64_t items, int64_t grain) {
    if (items <= 0) return;
    grain = grain < 1 ? 1 : grain;
    const int64_t chunks = (items + grain - 1) / grain;
    if (!entered) {
        run_on_openmp(task, arg, items, grain, chunks);
        return;
    }
    int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
    threads = threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : threads;
    if (threads <= 1 || chunks <= 1 || chunks > UINT32_MAX || pthread_mutex_trylock(&pool.busy) != 0) {
        task(arg, 0, items);
        return;
    }
    const int helpers = start_workers(threads - 1);
    atomic_store_explicit(&pool.task, task, memory_order_relaxed);
    atomic_store_explicit(&pool.arg, arg, memory_order_relaxed);
    atomic_store_explicit(&pool.items, items, memory_order_relaxed);
    atomic_store_explicit(&pool.grain, grain, memory_order_relaxed);
    atomic_store_explicit(&pool.chunks, chunks, memory_order_relaxed);
    atomic_store_explicit(&pool.helpers, helpers, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const uint64_t s = ((atomic_load_explicit(&pool.state, memory_order_relaxed) >> 32) + 1) << 32;
    atomic_store(&pool.state, s); /* publishes the fields above; sequentially consistent with `sleepers` */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep);
    }
    help(s);
    for (unsigned spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++) {
        if (spins < YIELD_AFTER) cpu_relax();
        else sched_yield(); /* a worker preempted inside its chunk: let it have this core */
    }
    pthread_mutex_unlock(&pool.busy);
}

int64_t pool_grain(int64_t items, int64_t multiple) {
    const int threads = omp_get_max_threads();
    int64_t grain = items / ((int64_t)CHUNKS_PER_THREAD * (threads > 0 ? threads : 1));
    grain = (grain + multiple - 1) / multiple * multiple;
    return grain < multiple ? multiple : grain;
}
