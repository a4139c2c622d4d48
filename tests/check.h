/* Minimal test harness shared by the C unit tests: CHECK counts passes and
 * failures; finish with CHECK_SUMMARY() as main's return value. */
#ifndef STILL_TEST_CHECK_H
#define STILL_TEST_CHECK_H

#include <stdio.h>

static int n_pass, n_fail;
#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (cond) n_pass++;                                                       \
        else { n_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
    } while (0)
#define CHECK_SUMMARY() (printf("%d passed, %d failed\n", n_pass, n_fail), n_fail != 0)

#endif
