/* Context-switch-heavy workload: pairs of threads bounce a byte through
 * pipes, and optional spinners keep the run queues busy so that wake-ups
 * wait. Usage: ctxswitch SECONDS PAIRS [SPINNERS]. Prints the round trips. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile int stop;
struct pair { int ab[2], ba[2]; long trips; };

static void *ping(void *arg)
{
    struct pair *p = arg;
    char c = 0;
    while (!stop) {
        if (write(p->ab[1], &c, 1) != 1 || read(p->ba[0], &c, 1) != 1)
            break;
        p->trips++;
    }
    close(p->ab[1]);
    return NULL;
}

static void *pong(void *arg)
{
    struct pair *p = arg;
    char c;
    while (read(p->ab[0], &c, 1) == 1)
        if (write(p->ba[1], &c, 1) != 1)
            break;
    close(p->ba[1]);
    return NULL;
}

static void *spin(void *arg)
{
    (void)arg;
    volatile unsigned long x = 0;
    while (!stop)
        x++;
    return NULL;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    int pairs = argc > 2 ? atoi(argv[2]) : 2;
    int spinners = argc > 3 ? atoi(argv[3]) : 0;
    struct pair *ps = calloc(pairs, sizeof(*ps));
    pthread_t *th = calloc(2 * pairs + spinners, sizeof(*th));
    int n = 0;
    for (int i = 0; i < pairs; i++) {
        if (pipe(ps[i].ab) || pipe(ps[i].ba))
            return 1;
        pthread_create(&th[n++], NULL, pong, &ps[i]);
        pthread_create(&th[n++], NULL, ping, &ps[i]);
    }
    for (int i = 0; i < spinners; i++)
        pthread_create(&th[n++], NULL, spin, NULL);
    struct timespec ts = { (time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9) };
    nanosleep(&ts, NULL);
    stop = 1;
    long trips = 0;
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < pairs; i++)
        trips += ps[i].trips;
    printf("%ld\n", trips);
    return 0;
}
