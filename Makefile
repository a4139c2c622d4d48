# Thin wrapper around CMake/CTest. See README.md.
BUILD      ?= build
BUILD_ASAN ?= build-asan
JOBS       ?= $(shell nproc)
MODEL      ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT     ?= Write a short poem about the sea.
# make run's linearized model (the committed adapter: stage 1 + stage 2's LoRA); ADAPTER= for the original softmax model
ADAPTER    ?= adapters/smollm2-135m-still.gguf

# the engine's C sources (src/ by layer; the command line in src/cli/), for the hand-written static builds
ENGINE_SRCS = $(shell find src -name '*.c' -not -path 'src/cli/*' -not -path 'src/serve/*' | sort)
CLI_SRCS    = $(wildcard src/cli/*.c)

.PHONY: all build asan cuda model test test-unit test-asan run bench bench-long peer static static-cuda clean

all: build

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(BUILD_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

asan:
	@cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DSTILL_SANITIZE=ON -DSTILL_CUDA=OFF >/dev/null
	@cmake --build $(BUILD_ASAN) -j $(JOBS)

# `make` builds the CUDA backend too wherever a CUDA compiler is found (CMake's
# STILL_CUDA defaults to on then; BUILD_FLAGS=-DSTILL_CUDA=OFF skips it).
# `make cuda` insists on it, in build-cuda/ (the GPU test programs, docs/cuda.md).
BUILD_GPU ?= build-cuda
cuda:
	@cmake -S . -B $(BUILD_GPU) -DCMAKE_BUILD_TYPE=Release -DSTILL_CUDA=ON >/dev/null
	@cmake --build $(BUILD_GPU) -j $(JOBS)

model: $(MODEL)

$(MODEL):
	@scripts/fetch-model.sh

# Everything CI checks: the unit tests under AddressSanitizer/
# UndefinedBehaviorSanitizer, then unit + integration tests in the release
# build. CTest's summary line is the last line printed. Where a CUDA compiler
# is found (CI has one, without a GPU) the release build has the CUDA backend
# and its GPU-free self-test (cuda_cpu_selftest) is one of the tests.
test: build asan model
	@grep -q "^STILL_CUDA:BOOL=ON" $(BUILD)/CMakeCache.txt || echo "make test: no CUDA compiler found, the CUDA backend is not compiled"
	@cd $(BUILD_ASAN) && ctest --output-on-failure -L unit
	@cd $(BUILD) && ctest --output-on-failure

run: build model
	$(BUILD)/still chat -m $(MODEL) $(if $(ADAPTER),--adapter $(ADAPTER)) -p "$(PROMPT)" -n 256 --temp 0.7 \
	    --repeat-penalty 1.1 --seed 1

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
	  -I/usr/include/$$(gcc -print-multiarch)/openblas-openmp $(ENGINE_SRCS) $(CLI_SRCS) -DSTILL_NO_CJSON -static -o dist/still \
	  /usr/lib/$$(gcc -print-multiarch)/openblas-openmp/libopenblas.a -lpcre2-8 -lm

# The CUDA build for a GPU machine without the CPU engine's libraries:
# dist/still-cuda (PCRE2, OpenBLAS, libgomp and libstdc++ linked in; glibc,
# the CUDA runtime and cuBLASLt from that machine, found through
# /usr/local/cuda), plus the GPU test programs test_cuda_kernels and
# test_model_cuda and the attention benchmark bench_attn_cuda (docs/cuda.md).
BUILD_CUDA ?= build-cuda-lib
CUDA_HOME ?= /usr/local/cuda
static-cuda:
	@mkdir -p dist
	cmake -S cuda -B $(BUILD_CUDA) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD_CUDA) -j $(JOBS)
	$(eval MA := $(shell gcc -print-multiarch))
	$(eval CUDA_LINK := $(BUILD_CUDA)/libstill_cuda.a -L$(CUDA_HOME)/lib64 -lcudart_static -lcublasLt \
	  -Wl,-rpath,$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/targets/x86_64-linux/lib \
	  /usr/lib/$(MA)/openblas-openmp/libopenblas.a /usr/lib/$(MA)/libpcre2-8.a \
	  -static-libgcc -Wl,-Bstatic -lstdc++ -lgomp -Wl,-Bdynamic -lm -ldl -lrt -lpthread)
	$(CC) -O3 -march=x86-64-v3 -fopenmp -std=gnu11 -Wno-psabi -D_GNU_SOURCE -DSTILL_HAVE_CUDA=1 -DSTILL_NO_CJSON -Iinclude -Isrc -Icuda \
	  -I/usr/include/$(MA)/openblas-openmp $(ENGINE_SRCS) $(CLI_SRCS) -o dist/still-cuda $(CUDA_LINK)
	$(CC) -O3 -march=x86-64-v3 -fopenmp -std=gnu11 -Wno-psabi -D_GNU_SOURCE -DSTILL_HAVE_CUDA=1 -DSTILL_NO_CJSON -Iinclude -Isrc -Icuda \
	  -I/usr/include/$(MA)/openblas-openmp tests/cuda/test_model_cuda.c $(ENGINE_SRCS) -o dist/test_model_cuda $(CUDA_LINK)
	cp $(BUILD_CUDA)/test_cuda_kernels $(BUILD_CUDA)/bench_attn_cuda dist/

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
