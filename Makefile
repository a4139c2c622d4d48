# Thin wrapper around CMake/CTest. See README.md.
BUILD      ?= build
BUILD_ASAN ?= build-asan
JOBS       ?= $(shell nproc)
MODEL      ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT     ?= Write a short poem about the sea.

.PHONY: all build asan model test test-unit test-asan run bench bench-long peer static clean

all: build

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

asan:
	@cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DSTILL_SANITIZE=ON >/dev/null
	@cmake --build $(BUILD_ASAN) -j $(JOBS)

model: $(MODEL)

$(MODEL):
	@scripts/fetch-model.sh

# Everything CI checks: unit + integration tests in the release build, then the
# unit tests again under AddressSanitizer/UndefinedBehaviorSanitizer.
# CTest's summary line is the last line printed.
test: build asan model
	@cd $(BUILD_ASAN) && ctest --output-on-failure -L unit
	@cd $(BUILD) && ctest --output-on-failure

run: build model
	$(BUILD)/still chat -m $(MODEL) -p "$(PROMPT)" -n 256 --temp 0.7 --repeat-penalty 1.1 --seed 1

bench: build model
	@scripts/bench.sh

# The long-context sweep (scripts/bench-long.sh): prefill time, decode
# ms/token at depth and memory at 1K..64K tokens for every attention kind and
# llama.cpp; CSVs, summary.md and gnuplot PNGs in bench/results/long-DATE/.
# Slow (every cell at 64K prefills 64K tokens for its warm-up and for each
# repetition) but resumable. Knobs: LENGTHS KINDS THREADS REPS NGEN OUT
# SKIP_PEER=1 (no llama.cpp).
bench-long: build model
	@[ "$(SKIP_PEER)" = 1 ] || scripts/build-llama-cpp.sh >/dev/null
	@MODEL="$(MODEL)" scripts/bench-long.sh

peer:
	@scripts/build-llama-cpp.sh

# A self-contained binary (static glibc, PCRE2, OpenBLAS, libgomp; AVX2
# baseline) for a machine without the libraries, e.g. to train or evaluate
# elsewhere with scripts/linearize-remote.sh and scripts/eval-remote.sh.
# Debian ships no static cJSON, so this build leaves out multiple-choice
# scoring (it reports that it is missing).
static:
	@mkdir -p dist
	$(CC) -O3 -march=x86-64-v3 -fopenmp -std=gnu11 -D_GNU_SOURCE -Iinclude -Isrc \
	  -I/usr/include/$$(gcc -print-multiarch)/openblas-openmp src/*.c src/cli/*.c -DSTILL_NO_CJSON -static -o dist/still \
	  /usr/lib/$$(gcc -print-multiarch)/openblas-openmp/libopenblas.a -lpcre2-8 -lm

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
