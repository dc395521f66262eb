# train_roundpipe — build
#
#   make            build ./train_roundpipe (CPU backend always; CUDA kernels too when nvcc exists)
#   make test       build and run ./test_roundpipe (last line: "N passed, M failed")
#   make clean
#
# Host code: C11, gcc, -Wall -Wextra -Werror -O3. CUDA code only in kernels/*.cu, compiled by nvcc
# for GPU_ARCH (default sm_90) when nvcc is on the PATH (or NVCC=...); NO_CUDA=1 forces a CPU-only
# build. Building never needs a GPU to be present.

CC ?= gcc
ifeq ($(CC),cc)
CC := gcc
endif
GPU_ARCH ?= sm_90
NVCC ?= $(shell command -v nvcc 2>/dev/null || (test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc))

CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -fno-strict-aliasing
OPTFLAGS ?= -O3 -g
CFLAGS += $(CFLAGS_BASE) $(OPTFLAGS)
LDLIBS := -lm -pthread

BUILD := build
LIB_SRCS := $(sort $(wildcard llmc/*.c))
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
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
NVCCFLAGS ?= -O3 -std=c++17 -arch=$(GPU_ARCH) -lineinfo -Xcompiler -Wall,-Werror,-fPIC --expt-relaxed-constexpr
CFLAGS += -DHAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib -lcublasLt -lcublas -lcudart -lstdc++
CU_OBJS := $(patsubst kernels/%.cu,$(BUILD)/kernels/%.o,$(CU_SRCS))
BUILD_NOTE := building with CUDA ($(NVCC), $(GPU_ARCH))
else
CU_OBJS :=
BUILD_NOTE := nvcc not found (or NO_CUDA=1): building the CPU-only trainer
endif

LIB_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(LIB_SRCS))
TEST_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(TEST_SRCS))

.PHONY: all test clean note
all: note train_roundpipe test_roundpipe

note:
	@echo "$(BUILD_NOTE)"

train_roundpipe: $(BUILD)/train_roundpipe.o $(LIB_OBJS) $(CU_OBJS)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

test_roundpipe: $(BUILD)/test_roundpipe.o $(TEST_OBJS) $(LIB_OBJS) $(CU_OBJS)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c $(wildcard llmc/*.h) $(wildcard llmc/tests/*.h) $(wildcard kernels/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/kernels/%.o: kernels/%.cu $(wildcard kernels/*.h) $(wildcard kernels/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<

# The test binary runs the CLI end to end, so it needs ./train_roundpipe too.
test: note train_roundpipe test_roundpipe
	./test_roundpipe

clean:
	rm -rf $(BUILD) train_roundpipe test_roundpipe
