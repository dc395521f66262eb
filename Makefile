# train_roundpipe — build
#
#   make            build ./train_roundpipe (CPU backend always; CUDA kernels too when nvcc exists)
#   make test       build and run ./test_roundpipe (last line: "N passed, M failed, K skipped"; it
#                   fails on any failed test; tests that cannot run here, e.g. the `gpu` suite on
#                   a machine without a GPU, are reported as skipped and do not fail it)
#   make test-gpu   build with CUDA and run the `gpu` suite (the CUDA backend and engine against
#                   the CPU ones); it FAILS when the suite cannot run (no GPU, or no CUDA build)
#   make dev-cuda   build the CUDA kernel labs of dev/cuda into dev/cuda/build (validation and
#                   benchmark per kernel family; they need a GPU to run: dev/cuda/run_labs.sh)
#   make clean
#   make tsan       ThreadSanitizer build of the tests (build-tsan/), runs the suites in TSAN_SUITES
#   make asan       AddressSanitizer+UBSan build of the tests and of the trainer (build-asan/),
#                   runs ASAN_SUITES (empty = the whole suite), the CLI tests against the
#                   sanitized trainer; `make clean-san` removes both builds
#   make fuzz       libFuzzer targets of dev/fuzz (clang), each run FUZZ_SECONDS from its seeds
#
# Host code: C11, gcc, -Wall -Wextra -Werror -O3. CUDA code only in kernels/*.cu, compiled by nvcc
# for GPU_ARCH when nvcc is on the PATH (or NVCC=...); NO_CUDA=1 forces a CPU-only build. Building
# never needs a GPU to be present. The CUDA build links NCCL (-lnccl: libnccl.so beside CUDA's
# libraries in $(CUDA_HOME)/lib or lib64, nccl.h on the include path) for the data-parallel
# communicator llmc/comm_nccl.c. GPU_ARCH defaults to sm_90a, the architecture-specific Hopper
# target (H100/H200): the wgmma attention forward needs it (its machine code runs on compute
# capability 9.0 only). For other GPUs set GPU_ARCH=sm_80, sm_89, sm_100, ...: the attention
# forward then runs its mma.sync kernel.

CC ?= gcc
ifeq ($(CC),cc)
CC := gcc
endif
GPU_ARCH ?= sm_90a
NVCC ?= $(shell command -v nvcc 2>/dev/null || (test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc))

CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -fno-strict-aliasing
OPTFLAGS ?= -O3 -g
CFLAGS += $(CFLAGS_BASE) $(OPTFLAGS)
LDLIBS := -lm -pthread

# Objects of CUDA and CPU-only builds differ (-DHAVE_CUDA): keep them apart, so switching with
# NO_CUDA=1 never links stale objects.
BUILD_ROOT := build
LIB_SRCS := $(sort $(wildcard llmc/*.c)) $(sort $(wildcard llmc/engine/*.c))
TEST_SRCS := $(sort $(wildcard llmc/tests/*.c))
CU_SRCS := $(sort $(wildcard kernels/*.cu))

# ---- CUDA detection ----
ifeq ($(NO_CUDA),1)
NVCC :=
endif
ifneq ($(strip $(NVCC)),)
ifneq ($(strip $(CU_SRCS)),)
USE_CUDA := 1
endif
endif

ifeq ($(USE_CUDA),1)
BUILD := $(BUILD_ROOT)/cuda
else
BUILD := $(BUILD_ROOT)/cpu
endif

ifeq ($(USE_CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# (the wgmma attention kernels exist only in sm_90a device code; the host side asks ATTN_WGMMA_BUILD)
NVCCFLAGS ?= -O3 -std=c++17 -arch=$(GPU_ARCH) -lineinfo -Xcompiler -Wall,-Werror,-fPIC --expt-relaxed-constexpr \
             -DCUDA_BUILD_ARCH='"$(GPU_ARCH)"' $(if $(filter sm_90a,$(GPU_ARCH)),-DATTN_WGMMA_BUILD=1)
CFLAGS += -DHAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib -Wl,-rpath,$(CUDA_HOME)/lib64 \
          -L$(CUDA_HOME)/lib -Wl,-rpath,$(CUDA_HOME)/lib -lnccl -lcublasLt -lcublas -lcudart -lstdc++
CU_OBJS := $(patsubst kernels/%.cu,$(BUILD)/kernels/%.o,$(CU_SRCS))
BUILD_NOTE := building with CUDA ($(NVCC), $(GPU_ARCH))
# The CUDA objects depend on GPU_ARCH, which no source file shows: a stamp that changes with it
# recompiles them when it switches (else objects of two targets would be linked together).
ARCH_STAMP := $(BUILD)/arch.stamp
$(shell mkdir -p $(BUILD); test "`cat $(ARCH_STAMP) 2>/dev/null`" = "$(GPU_ARCH)" || echo "$(GPU_ARCH)" > $(ARCH_STAMP))
else
CU_OBJS :=
ifeq ($(NO_CUDA),1)
BUILD_NOTE := NO_CUDA=1: building the CPU-only trainer
else ifeq ($(strip $(NVCC)),)
BUILD_NOTE := nvcc not found: building the CPU-only trainer
else
BUILD_NOTE := nvcc found but no kernels/*.cu sources: building the CPU-only trainer
endif
endif

# The binaries are shared by both configurations: a stamp that changes with the configuration
# makes them relink when it switches.
CONFIG_NAME := $(if $(filter 1,$(USE_CUDA)),cuda-$(GPU_ARCH),cpu)
CONFIG_STAMP := $(BUILD_ROOT)/config.stamp
$(shell mkdir -p $(BUILD_ROOT); test "`cat $(CONFIG_STAMP) 2>/dev/null`" = "$(CONFIG_NAME)" || echo "$(CONFIG_NAME)" > $(CONFIG_STAMP))

LIB_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(LIB_SRCS))
TEST_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(TEST_SRCS))

.PHONY: all test clean note
all: note train_roundpipe test_roundpipe

note:
	@echo "$(BUILD_NOTE)"

train_roundpipe: $(BUILD)/train_roundpipe.o $(LIB_OBJS) $(CU_OBJS) $(CONFIG_STAMP)
	$(CC) $(CFLAGS) -o $@ $(filter %.o,$^) $(LDLIBS)

test_roundpipe: $(BUILD)/test_roundpipe.o $(TEST_OBJS) $(LIB_OBJS) $(CU_OBJS) $(CONFIG_STAMP)
	$(CC) $(CFLAGS) -o $@ $(filter %.o,$^) $(LDLIBS)

$(BUILD)/%.o: %.c $(wildcard llmc/*.h) $(wildcard llmc/engine/*.h) $(wildcard llmc/tests/*.h) \
              $(wildcard kernels/*.h) $(wildcard dev/fuzz/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/kernels/%.o: kernels/%.cu $(wildcard kernels/*.h) $(wildcard kernels/*.cuh) $(wildcard llmc/*.h) \
                      $(ARCH_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<

# The test binary runs the CLI end to end, so it needs ./train_roundpipe too.
test: note train_roundpipe test_roundpipe
	./test_roundpipe

# The GPU suite alone (it compares the CUDA backend with the CPU one on every op, the model and the
# engine). Whoever asks for it wants to know it ran: --no-skip turns "skipped" (no GPU here) into
# a failure.
.PHONY: test-gpu dev-cuda
test-gpu: note test_roundpipe
ifneq ($(USE_CUDA),1)
	@echo "test-gpu: this build has no CUDA ($(BUILD_NOTE))"; exit 1
endif
	./test_roundpipe --no-skip gpu

# Kernel labs (dev/cuda/<family>.cu, one per kernel family of kernels/; the attention lab builds
# on its own: dev/cuda/run_attention.sh). Each lab includes its family's production source
# kernels/<family>.cu, so it links every other kernels/ object and the host library, never that
# one. Binaries go to dev/cuda/build/; dev/cuda/run_labs.sh runs them all on a GPU.
DEV_CUDA_LABS := norm rope elementwise embedding loss matmul moe moe_matmul dequant decode
DEV_CUDA_DIR := dev/cuda/build
DEV_CUDA_BINS := $(patsubst %,$(DEV_CUDA_DIR)/%,$(DEV_CUDA_LABS))
ifeq ($(USE_CUDA),1)
dev-cuda: note $(DEV_CUDA_BINS)
else
dev-cuda: note
	@echo "dev-cuda: this build has no CUDA ($(BUILD_NOTE))"; exit 1
endif
$(DEV_CUDA_DIR)/%: dev/cuda/%.cu kernels/%.cu dev/cuda/lab.cuh $(CU_OBJS) $(LIB_OBJS) \
                   $(wildcard kernels/*.h) $(wildcard kernels/*.cuh) $(wildcard llmc/*.h) $(ARCH_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(filter-out $(BUILD)/kernels/$*.o,$(CU_OBJS)) $(LIB_OBJS) \
	    -Xlinker -rpath,$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -lnccl -lcublasLt -lcublas -lm

clean:
	rm -rf $(BUILD_ROOT) $(DEV_CUDA_DIR) train_roundpipe test_roundpipe

# ---- sanitizer builds ----
# CPU-only test binaries with their own object directories, so they never mix with the normal
# build. TSan checks the CPU device emulation and the engine's use of it (streams are threads);
# suites that do not exercise threads add nothing under TSan, so the list is explicit. The asan
# build also sanitizes the trainer (train_roundpipe_asan) and runs the CLI tests against it
# (TRAIN_ROUNDPIPE_BIN, which test_run_cli honours): a leak or an overflow in a run fails its test.
SAN_CC ?= $(CC)
SAN_OPTFLAGS ?= -O1 -g -fno-omit-frame-pointer
TSAN_SUITES ?= device engine comm_ dp_trainer dp_rank_failure
ASAN_SUITES ?=
TSAN_BUILD := build-tsan
ASAN_BUILD := build-asan
TSAN_FLAGS := $(CFLAGS_BASE) $(SAN_OPTFLAGS) -fsanitize=thread
ASAN_FLAGS := $(CFLAGS_BASE) $(SAN_OPTFLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined
SAN_SRCS := test_roundpipe.c $(TEST_SRCS) $(LIB_SRCS)
SAN_DEPS := $(wildcard llmc/*.h) $(wildcard llmc/engine/*.h) $(wildcard llmc/tests/*.h) \
            $(wildcard dev/fuzz/*.h)

.PHONY: tsan asan clean-san
tsan: test_roundpipe_tsan
	set -e; for s in $(TSAN_SUITES); do TSAN_OPTIONS="halt_on_error=1 $(TSAN_OPTIONS)" ./test_roundpipe_tsan $$s; done

ASAN_RUN := TRAIN_ROUNDPIPE_BIN=./train_roundpipe_asan ./test_roundpipe_asan
asan: train_roundpipe_asan test_roundpipe_asan
	$(if $(strip $(ASAN_SUITES)),set -e; for s in $(ASAN_SUITES); do $(ASAN_RUN) $$s; done,$(ASAN_RUN))

test_roundpipe_tsan: $(patsubst %.c,$(TSAN_BUILD)/%.o,$(SAN_SRCS))
	$(SAN_CC) $(TSAN_FLAGS) -o $@ $^ -lm -pthread

test_roundpipe_asan: $(patsubst %.c,$(ASAN_BUILD)/%.o,$(SAN_SRCS))
	$(SAN_CC) $(ASAN_FLAGS) -o $@ $^ -lm -pthread

train_roundpipe_asan: $(patsubst %.c,$(ASAN_BUILD)/%.o,train_roundpipe.c $(LIB_SRCS))
	$(SAN_CC) $(ASAN_FLAGS) -o $@ $^ -lm -pthread

$(TSAN_BUILD)/%.o: %.c $(SAN_DEPS)
	@mkdir -p $(dir $@)
	$(SAN_CC) $(TSAN_FLAGS) -c -o $@ $<

$(ASAN_BUILD)/%.o: %.c $(SAN_DEPS)
	@mkdir -p $(dir $@)
	$(SAN_CC) $(ASAN_FLAGS) -c -o $@ $<

clean-san:
	rm -rf $(TSAN_BUILD) $(ASAN_BUILD) test_roundpipe_tsan test_roundpipe_asan train_roundpipe_asan

# ---- libFuzzer targets (dev/fuzz) ----
# One binary per parser (json, safetensors, gguf, shard, tokenizer: build-fuzz/fuzz_<t>), built by
# clang with -fsanitize=fuzzer,address,undefined, then run for FUZZ_SECONDS each from the committed
# seeds in dev/fuzz/corpus/<t> (never modified: new inputs go to build-fuzz/corpus-<t>). `make test`
# runs the same entry points over the seeds and mutations without libFuzzer (suites gguf, tokenizer).
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 30
FUZZ_TARGETS := json safetensors gguf shard tokenizer
FUZZ_BUILD := build-fuzz
FUZZ_FLAGS := $(CFLAGS_BASE) -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
FUZZ_LIB := llmc/common.c llmc/json.c llmc/safetensors.c llmc/gguf_read.c llmc/gguf_quant.c \
            llmc/gguf_arch.c llmc/gguf_write.c llmc/config.c llmc/tensor.c \
            llmc/dataloader.c llmc/rng.c
FUZZ_LIB += llmc/tokenizer.c llmc/tokenizer_load.c llmc/tokenizer_export.c llmc/unicode.c \
            llmc/unicode_tables.c

.PHONY: fuzz fuzz-build
fuzz: fuzz-build
	set -e; for t in $(FUZZ_TARGETS); do mkdir -p $(FUZZ_BUILD)/corpus-$$t; \
	    $(FUZZ_BUILD)/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 \
	        $(FUZZ_BUILD)/corpus-$$t dev/fuzz/corpus/$$t; done

fuzz-build: $(patsubst %,$(FUZZ_BUILD)/fuzz_%,$(FUZZ_TARGETS))

$(FUZZ_BUILD)/fuzz_%: dev/fuzz/fuzz_%.c dev/fuzz/fuzz_entries.h $(FUZZ_LIB) $(wildcard llmc/*.h)
	@mkdir -p $(FUZZ_BUILD)
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ $< $(FUZZ_LIB) -lm
