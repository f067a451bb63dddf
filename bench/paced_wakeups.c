/* Paced context switches: one pair of threads bounces a byte through pipes
 * at a fixed rate of round trips, for a while. Every round trip wakes two
 * sleeping threads, so the scheduler program sees about 2 x RATE run-queue
 * events a second from it. Usage: paced_wakeups SECONDS ROUND_TRIPS_PER_S.
 * Prints the round trips made. With a third argument "stdin" it paces on
 * request instead: each line "S" on stdin paces for S seconds and prints
 * the round trips made then; it ends at end of input. A tracer scoped to
 * its pid then sees load and quiet in turn from one process. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int ab[2], ba[2];

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *pong(void *arg)
{
    char c;
    (void)arg;
    while (read(ab[0], &c, 1) == 1)
        if (write(ba[1], &c, 1) != 1)
            break;
    return NULL;
}

/* Round trips at `rate` a second for `seconds`; the number made, or -1. */
static long pace(double seconds, double rate)
{
    double start = now(), end = start + seconds;
    long trips = 0;
    char c = 0;
    /* Batches a millisecond apart: the pacing sleep is one more wake-up
     * per batch, not per round trip. */
    while (now() < end) {
        long due = (long)((now() - start) * rate);
        for (; trips < due; trips++)
            if (write(ab[1], &c, 1) != 1 || read(ba[0], &c, 1) != 1)
                return -1;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    return trips;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    double rate = argc > 2 ? atof(argv[2]) : 1000.0;
    int on_request = argc > 3 && strcmp(argv[3], "stdin") == 0;
    if (pipe(ab) || pipe(ba))
        return 1;
    pthread_t t;
    pthread_create(&t, NULL, pong, NULL);
    long trips = 0;
    if (on_request) {
        char line[64];
        setvbuf(stdout, NULL, _IOLBF, 0);
        printf("ready\n");
        while (fgets(line, sizeof(line), stdin)) {
            long made = pace(atof(line), rate);
            if (made < 0)
                return 1;
            printf("%ld\n", made);
        }
    } else if ((trips = pace(seconds, rate)) < 0) {
        return 1;
    }
    close(ab[1]);
    pthread_join(t, NULL);
    if (!on_request)
        printf("%ld\n", trips);
    return 0;
}
