# The two commands of the README: `make demo` and `make test`.
# Both install what is missing first: Debian's packages (apt-get, as root) and a
# virtual environment .venv with PyTorch from PyPI (UCKPT_PYTHON=/path/to/python
# uses a Python that has PyTorch instead; scripts/python-env.sh).

JOBS ?= $(shell nproc)
BUILD ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
# `make fuzz`: 5 minutes per target; `make test` runs each for TEST_FUZZ_SECONDS.
FUZZ_SECONDS ?= 300
TEST_FUZZ_SECONDS ?= 10

.PHONY: all deps build python demo test test-full test-asan fuzz fuzz-keep bench clean

all: build

deps:
	@bash scripts/install-deps.sh

# Everything, with the test libraries (transformers, Accelerate, PEFT, TRL, DeepSpeed 0.14.5).
# On a fresh machine the parts without libtorch, and their tests, compile while the Python packages
# install (scripts/build.sh).
build:
	bash scripts/build.sh $(BUILD) $(JOBS) test

# The Python package: build/python/uckpt (PYTHONPATH=build/python .venv/bin/python -c 'import uckpt').
python:
	bash scripts/configure.sh $(BUILD)
	cmake --build $(BUILD) --target python -j $(JOBS)

# The demo needs the `uckpt` program only: the tests and benchmarks compile under `make test`.
# On a fresh machine the parts without libtorch compile while PyTorch installs (scripts/build.sh).
demo:
	bash scripts/build.sh $(BUILD) $(JOBS) demo
	bash scripts/demo.sh $(BUILD)

# `make test` (CI's command, under an hour on 2 cores): the normal build's tests but those labelled
# `full`, then the layers without libtorch under ASan/UBSan and their fuzz targets for
# TEST_FUZZ_SECONDS each. `make test-full` runs the `full` tests too: more configurations of paths
# `make test` already takes, most against real DeepSpeed or through the Hugging Face stack
# (tests/README.md lists them and why).
test: CTEST_SELECT = -LE '^full$$'
test-full: CTEST_SELECT =
test test-full: build
	@# A fresh build has no test timings: seed them so that ctest starts the longest tests first
	@# (tests/ctest-costs.txt: the tests over 5 s of a full run's Testing/Temporary/CTestCostData.txt).
	@mkdir -p $(BUILD)/Testing/Temporary
	@[ -f $(BUILD)/Testing/Temporary/CTestCostData.txt ] || cp tests/ctest-costs.txt $(BUILD)/Testing/Temporary/CTestCostData.txt
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_SELECT); rc=$$?; bash $(CURDIR)/scripts/sweep-deepspeed-shm.sh; exit $$rc
	$(MAKE) test-asan

# One clang build serves the sanitizer tests and the fuzz targets (the libraries carry
# libFuzzer's coverage instrumentation, which the sanitizer runtime accepts unused).
test-asan: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" \
	  -DUCKPT_SANITIZE=ON -DUCKPT_FUZZ=ON -DUCKPT_BENCH=OFF \
	  -DCMAKE_CXX_COMPILER=clang++ -DUCKPT_ASAN_ONLY_FORMAT=ON -DPython3_EXECUTABLE=$$(bash scripts/python-env.sh)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS) -L 'format|corrupt'
	cd $(ASAN_BUILD) && FUZZ_SECONDS=$(TEST_FUZZ_SECONDS) ctest --output-on-failure -j $(JOBS) -L fuzz

fuzz: deps
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUCKPT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++
	cmake --build $(FUZZ_BUILD) -j $(JOBS)
	cd $(FUZZ_BUILD) && FUZZ_SECONDS=$(FUZZ_SECONDS) ctest --output-on-failure -L fuzz

# After a `make fuzz` without findings: add to the checked-in seed corpora only
# the inputs of the last run that reach new coverage (libFuzzer -merge=1).
fuzz-keep:
	for t in fuzz_zip fuzz_pickle fuzz_torch_file fuzz_checkpoint; do \
	  $(FUZZ_BUILD)/tests/fuzz/$$t -merge=1 tests/fuzz/corpus/$$t $(FUZZ_BUILD)/tests/fuzz/work/$$t/corpus || exit 1; \
	done

bench: build
	bash bench/torch_file.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
