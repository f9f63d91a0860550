"""The decode path's threads (cpu_ops/pool.c): every item of every job run exactly once, whoever
claims it; callers that overlap, a job's own chunks that call it, OpenMP outside pool_enter, and
a child of fork all get their whole job done, and nothing hangs."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from stages.gpu_runner.cpu_ops import build as cpu_build

pytestmark = pytest.mark.timeout(120)

# Jobs of every size and grain, each item counted as its chunk runs it; some chunks sleep (a worker
# or the caller late inside one). Each check returns the number of wrong counts it saw.
DRIVER = r"""
#define _GNU_SOURCE
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"

#define MAX_ITEMS 4096

static _Atomic int helped; /* chunks run by a thread other than the job's caller */
static _Thread_local int calling;

typedef struct {
    _Atomic int counts[MAX_ITEMS];
    int64_t sleepy; /* a chunk beginning at a multiple of this sleeps 50 us (0: none) */
    int nested;     /* each chunk runs a job of its own: inline, as the pool is busy */
} job;

static void count(void *p, int64_t begin, int64_t end) {
    job *j = p;
    if (!calling) atomic_fetch_add(&helped, 1);
    if (j->sleepy && begin % j->sleepy == 0) {
        struct timespec t = {0, 50000};
        nanosleep(&t, NULL);
    }
    for (int64_t i = begin; i < end; i++) atomic_fetch_add(&j->counts[i], 1);
    if (j->nested) {
        job *inner = calloc(1, sizeof(job));
        pool_run(count, inner, 100, 7);
        for (int i = 0; i < 100; i++)
            if (atomic_load(&inner->counts[i]) != 1) atomic_fetch_add(&j->counts[MAX_ITEMS - 1], 1000);
        free(inner);
    }
}

static long jobs(int n, unsigned seed, int sleepy, int nested) {
    long wrong = 0;
    job *j = calloc(1, sizeof(job));
    for (int k = 0; k < n; k++) {
        const int64_t items = 1 + rand_r(&seed) % (MAX_ITEMS - 1), grain = 1 + rand_r(&seed) % 97;
        for (int64_t i = 0; i < MAX_ITEMS; i++) atomic_store(&j->counts[i], 0);
        j->sleepy = sleepy ? 1 + rand_r(&seed) % 13 : 0;
        j->nested = nested;
        calling = 1;
        pool_run(count, j, items, grain);
        calling = 0;
        for (int64_t i = 0; i < items; i++) wrong += atomic_load(&j->counts[i]) != 1;
        wrong += atomic_load(&j->counts[MAX_ITEMS - 1]) != 0; /* past every job's items: the nested jobs' errors */
    }
    free(j);
    return wrong;
}

long check_jobs(int threads, int n, int sleepy, int nested) {
    omp_set_num_threads(threads);
    pool_enter();
    const long wrong = jobs(n, 12345u + (unsigned)threads, sleepy, nested);
    pool_leave();
    return wrong;
}

long check_openmp(int threads, int n) { /* outside pool_enter: OpenMP's threads */
    omp_set_num_threads(threads);
    return pool_entered() ? 1000000 : jobs(n, 777u, 0, 0);
}

static void *caller(void *seed) {
    omp_set_num_threads(2);
    pool_enter();
    long *wrong = malloc(sizeof(long));
    *wrong = jobs(2000, (unsigned)(intptr_t)seed, 0, 0);
    pool_leave();
    return wrong;
}

long check_overlapping_callers(void) { /* one holds the pool, the other runs its jobs inline */
    pthread_t threads[3];
    long wrong = 0;
    for (intptr_t i = 0; i < 3; i++) pthread_create(&threads[i], NULL, caller, (void *)(i + 1));
    for (int i = 0; i < 3; i++) {
        void *result;
        pthread_join(threads[i], &result);
        wrong += *(long *)result;
        free(result);
    }
    return wrong;
}

/* The parent's workers started, then fork: the child's jobs are done by its own threads, a worker
 * of its own among them. 0, the child's wrong count (1, or 2 where no worker helped), or -1 where
 * it did not finish within 20 s. */
long check_fork(void) {
    long wrong = check_jobs(2, 50, 0, 0);
    const pid_t child = fork();
    if (child == 0) {
        atomic_store(&helped, 0);
        const long child_wrong = check_jobs(2, 500, 1, 0);
        _exit(child_wrong != 0 ? 1 : atomic_load(&helped) == 0 ? 2 : 0);
    }
    for (int waited = 0; waited < 2000; waited++) {
        int status;
        if (waitpid(child, &status, WNOHANG) == child)
            return wrong + (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
        struct timespec t = {0, 10000000};
        nanosleep(&t, NULL);
    }
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return -1;
}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    here = tmp_path_factory.mktemp("pool")
    (here / "driver.c").write_text(DRIVER)
    sources = Path(cpu_build.__file__).parent
    built = here / "pool.so"
    subprocess.run([compiler, "-O2", "-fopenmp", "-shared", "-fPIC", "-std=c11", f"-I{sources}",
                    str(sources / "pool.c"), str(here / "driver.c"), "-o", str(built)], check=True)
    lib = ctypes.CDLL(str(built))
    for name in ("check_jobs", "check_openmp", "check_overlapping_callers", "check_fork"):
        getattr(lib, name).restype = ctypes.c_long
    return lib


@pytest.mark.parametrize("threads", [1, 2, 3, 8])  # 3 and 8: more threads than this machine's cores
@pytest.mark.parametrize("sleepy", [False, True], ids=["even", "late-chunks"])
def test_every_item_runs_once(library, threads, sleepy):
    assert library.check_jobs(threads, 400, int(sleepy), 0) == 0


def test_a_chunk_that_runs_a_job_runs_it_inline(library):
    assert library.check_jobs(2, 200, 0, 1) == 0


def test_outside_pool_enter_openmp_runs_every_item_once(library):
    assert library.check_openmp(2, 400) == 0


def test_overlapping_callers_each_get_their_whole_jobs(library):
    assert library.check_overlapping_callers() == 0


def test_a_child_of_fork_runs_its_jobs_on_threads_of_its_own(library):
    assert library.check_fork() == 0
