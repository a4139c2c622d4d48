/* test_model.c with head dimension 64 and a GQA group of 2. */
#define TINY_DM 128
#define TINY_NH 2
#define TINY_NHK 1
#include "test_model.c"
