/* A latency-sensitive workload for QoS measurements: STEPS steps of a fixed
 * amount of CPU work (ITERS rounds of a xorshift), printing each step's wall
 * time in nanoseconds, one per line. Built static so it runs in any image. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: stepper STEPS ITERS\n");
        return 2;
    }
    long steps = atol(argv[1]), iters = atol(argv[2]);
    volatile unsigned long long x = 88172645463325252ULL;
    for (long s = 0; s < steps; s++) {
        long long t0 = now();
        unsigned long long v = x;
        for (long i = 0; i < iters; i++) {
            v ^= v << 13; v ^= v >> 7; v ^= v << 17;
        }
        x = v;
        printf("%lld\n", now() - t0);
    }
    return 0;
}
