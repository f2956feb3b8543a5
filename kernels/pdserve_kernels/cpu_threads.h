/* Helper threads for the plain-C CPU kernels: a call split into units, claimed from one ticket.
 *
 *   cpu_threads_run(fn, job, units, scratch_bytes, caller_scratch, threads)
 *
 * runs fn(job, i, scratch) for every unit i in [0, units), on the calling thread and up to
 * threads - 1 helper threads, and returns when all have run. Each thread passes fn its own scratch
 * of scratch_bytes (the caller its caller_scratch; a helper one it keeps and grows). Units must
 * write disjoint outputs; which thread runs a unit must not change its result.
 *
 * The calling thread publishes the job under a new generation g: ticket = g << 32. Every thread
 * (the caller and the helpers) claims unit i by a compare-and-swap of (g, i) to (g, i + 1), so a
 * helper that wakes late, for a job already over, fails its swap and claims nothing of the next.
 * The caller claims too, then waits until every claimed unit is done: a helper that never wakes
 * leaves its share to the caller. Helpers spin briefly for the next job (decode calls come every
 * layer), then sleep on a condition variable. One parallel call at a time (a second caller
 * meanwhile runs its call alone). At its end the caller closes the ticket (index all ones), so no
 * late swap succeeds while it writes the next job. After a fork the child has no helpers: it starts
 * its own.
 *
 * Everything here is static: each kernel library that includes it has its own pool.
 */
#ifndef PDSERVE_CPU_THREADS_H
#define PDSERVE_CPU_THREADS_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_HELPERS 63
#define SPIN_ROUNDS 1000 /* ~25 us of polling (pause: ~65 cycles) before a helper sleeps */

typedef void (*cpu_unit_fn)(const void *job, int64_t unit, void *scratch);

static cpu_unit_fn pool_fn;   /* the published job: written by its caller before the ticket */
static const void *pool_job;
static int64_t pool_scratch_bytes; /* what each helper's scratch must hold for the job */
static _Atomic uint64_t ticket;
static atomic_llong units_done;
static atomic_llong job_units;
static atomic_int sleepers;
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static uint64_t generation; /* guarded by call_mu */
static int helpers;         /* started in this process; guarded by call_mu */
static pid_t helpers_pid;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claims and runs units of generation g until none is left; returns how many it ran */
static int64_t run_units(uint64_t g, void *scratch) {
    int64_t ran = 0;
    for (;;) {
        uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
        if (t >> 32 != g) return ran;
        int64_t i = (int64_t)(t & 0xffffffffu);
        if (i >= atomic_load_explicit(&job_units, memory_order_relaxed)) return ran;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        pool_fn(pool_job, i, scratch);
        atomic_fetch_add_explicit(&units_done, 1, memory_order_release);
        ran++;
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&ticket) >> 32;
    void *sc = NULL;
    int64_t cap = 0;
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&ticket, memory_order_acquire) >> 32) == seen) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&wake_mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&ticket) >> 32 == seen) pthread_cond_wait(&wake_cv, &wake_mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&wake_mu);
            spins = 0;
        }
        seen = g;
        int64_t need = atomic_load_explicit(&job_units, memory_order_relaxed) > 0 ? pool_scratch_bytes : 0;
        if (need > cap) {
            void *grown = realloc(sc, (size_t)need);
            if (grown == NULL) continue; /* the caller runs this job's units */
            sc = grown, cap = need;
        }
        run_units(g, sc);
    }
    return NULL;
}

/* Helpers up to threads - 1 (started once per process); returns how many run */
static int ensure_helpers(int threads) {
    pid_t pid = getpid();
    if (helpers > 0 && helpers_pid != pid) { /* a forked child: its parent's helpers are not here */
        helpers = 0;
        pthread_mutex_init(&wake_mu, NULL);
        pthread_cond_init(&wake_cv, NULL);
        atomic_store(&sleepers, 0);
    }
    helpers_pid = pid;
    int want = threads - 1 < MAX_HELPERS ? threads - 1 : MAX_HELPERS;
    while (helpers < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        helpers++;
    }
    return helpers;
}

static void run_alone(cpu_unit_fn fn, const void *job, int64_t units, void *scratch) {
    for (int64_t i = 0; i < units; i++) fn(job, i, scratch);
}

/* Runs units [0, units) of job (see the top of this file) */
static void cpu_threads_run(cpu_unit_fn fn, const void *job, int64_t units, int64_t scratch_bytes,
                            void *caller_scratch, int64_t threads) {
    if (threads <= 1 || units < 2 || pthread_mutex_trylock(&call_mu) != 0) {
        run_alone(fn, job, units, caller_scratch);
        return;
    }
    if (ensure_helpers((int)threads) == 0) {
        pthread_mutex_unlock(&call_mu);
        run_alone(fn, job, units, caller_scratch);
        return;
    }
    pool_fn = fn, pool_job = job, pool_scratch_bytes = scratch_bytes;
    atomic_store(&units_done, 0);
    atomic_store(&job_units, units);
    uint64_t g = ++generation & 0xffffffffu;
    atomic_store(&ticket, g << 32); /* publishes the job (seq_cst: ordered before the sleepers check) */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&wake_mu);
        pthread_cond_broadcast(&wake_cv);
        pthread_mutex_unlock(&wake_mu);
    }
    run_units(g, caller_scratch);
    for (int spins = 0; atomic_load_explicit(&units_done, memory_order_acquire) < units; spins++) {
        if (spins < 1000)
            cpu_relax();
        else
            sched_yield(); /* a helper was preempted inside its unit */
    }
    /* Closed: a helper still holding this generation's ticket fails its swap, so the next job's
     * fields can be written while it is late */
    atomic_store(&ticket, (g << 32) | 0xffffffffu);
    pthread_mutex_unlock(&call_mu);
}

#endif
