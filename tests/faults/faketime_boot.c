/* faketime_boot.c: lets libfaketime run inside a process that uses jemalloc (redis-server).
 *
 * Preloaded before libfaketime.so.1. jemalloc initialises itself on the first malloc,
 * often from another library's constructor, and calls clock_gettime() and
 * pthread_cond_init() while doing so; libfaketime wraps both and, not yet initialised,
 * calls dlsym(), which mallocs again: recursion, then a deadlock (libfaketime issue 130).
 * Until this library's constructor has run (jemalloc is initialised by then), the two
 * calls go straight to the kernel / a zeroed condition variable; afterwards they go to
 * libfaketime, which fakes the wall clock as usual.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_fn)(clockid_t, struct timespec *);
typedef int (*cond_init_fn)(pthread_cond_t *, const pthread_condattr_t *);

static clock_fn next_clock_gettime;
static cond_init_fn next_cond_init;

int clock_gettime(clockid_t id, struct timespec *ts) {
    clock_fn next = __atomic_load_n(&next_clock_gettime, __ATOMIC_ACQUIRE);
    if (next == NULL)
        return (int)syscall(SYS_clock_gettime, id, ts);
    return next(id, ts);
}

int pthread_cond_init(pthread_cond_t *cond, const pthread_condattr_t *attr) {
    cond_init_fn next = __atomic_load_n(&next_cond_init, __ATOMIC_ACQUIRE);
    if (next == NULL && attr == NULL) {
        memset(cond, 0, sizeof *cond); /* what PTHREAD_COND_INITIALIZER is */
        return 0;
    }
    if (next == NULL)
        next = (cond_init_fn)dlvsym(RTLD_NEXT, "pthread_cond_init", "GLIBC_2.3.2");
    return next(cond, attr);
}

__attribute__((constructor)) static void boot(void) {
    free(malloc(16)); /* jemalloc is initialised from here on */
    cond_init_fn cond = (cond_init_fn)dlvsym(RTLD_NEXT, "pthread_cond_init", "GLIBC_2.3.2");
    clock_fn clock = (clock_fn)dlsym(RTLD_NEXT, "clock_gettime");
    __atomic_store_n(&next_cond_init, cond, __ATOMIC_RELEASE);
    __atomic_store_n(&next_clock_gettime, clock, __ATOMIC_RELEASE);
}
