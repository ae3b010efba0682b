# capsa: see README.md. Every target installs what it needs.
SHELL := /bin/bash
GO ?= go
export CAPSA_CACHE ?= $(HOME)/.cache/capsa
BUILD := build
NESTED := $(BUILD)/capsa-nested
# Test binaries for the KVM tier: packages whose tests need /dev/kvm, or
# the nested host's kernel (guestmem: its soft-dirty page tracking, which
# this machine's kernel lacks).
KVM_PKGS := ./kvm ./vmm ./guestmem
BENCHTIME ?= 5x
# Which benchmarks make bench runs (a -test.bench pattern): make bench BENCH=WorkspaceMeta
BENCH ?= .
VERSION := $(shell git describe --always --dirty 2>/dev/null || echo dev)
# Where `make install` puts capsa (PREFIX/bin) and the guest assets
# (PREFIX/share/capsa), and where the library looks for them last.
PREFIX ?= /usr/local
ASSETS_PKG := github.com/capsa-sandbox/capsa/internal/assets
# -s -w: no symbol table and no DWARF (8 MB of capsa; panics still print
# function names and lines, from the pclntab).
GO_LDFLAGS := -s -w -X main.version=$(VERSION) -X $(ASSETS_PKG).Prefix=$(PREFIX)

.PHONY: containerd-bundle proto test-programs soak fuzz all deps kernel initramfs assets install nested-deps qemu-bundle mcp-client capsa testinitrd testimages vm run test test-unit test-kvm test-e2e bench stress clean

all: capsa

deps:
	@command -v $(GO) >/dev/null || { echo "make: Go 1.26 is required (https://go.dev/dl)"; exit 1; }
	$(GO) mod download

kernel:
	scripts/build-kernel.sh $(BUILD)/kernel

nested-deps:
	scripts/nested-deps.sh >/dev/null

$(NESTED): deps
	$(GO) build -o $@ ./tests/nested/cmd/capsa-nested

# The guest initramfs: u-root's core commands and gosh, the agent as /init
# (stripped: its DWARF would be 1.4 MB of the compressed initramfs).
initramfs: deps
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o $(BUILD)/capsa-agent ./agent/cmd/capsa-agent
	scripts/build-initramfs.sh $(BUILD)/capsa-agent $(BUILD)/initramfs.cpio

# The guest asset set (package internal/assets): the kernel and initramfs
# compressed, with a manifest, in build/assets and in the build cache
# ($CAPSA_CACHE/assets), where the library finds it.
assets: deps kernel initramfs
	@command -v zstd >/dev/null || scripts/apt-install.sh zstd
	$(GO) run ./internal/assets/cmd/packassets -version $(VERSION) -o $(BUILD)/assets -o $(CAPSA_CACHE)/assets \
		$(BUILD)/kernel/vmlinux $(BUILD)/initramfs.cpio

# The capsa binary with the guest assets built in: one static file.
capsa: assets
	rm -rf internal/builtin/assets && cp -r $(BUILD)/assets internal/builtin/assets
	CGO_ENABLED=0 $(GO) build -trimpath -tags capsa_builtin -ldflags "$(GO_LDFLAGS)" -o $(BUILD)/capsa ./cmd/capsa
	@ls -l $(BUILD)/capsa

# capsa in PREFIX/bin and the asset set in PREFIX/share/capsa, for programs
# that use capsa as a library (the manifest last: a reader never sees a
# manifest naming files not yet there).
install: capsa
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/capsa
	install -m 0755 $(BUILD)/capsa $(DESTDIR)$(PREFIX)/bin/capsa
	ln -sf capsa $(DESTDIR)$(PREFIX)/bin/containerd-shim-capsa-v2
	install -m 0644 $(BUILD)/assets/*.zst $(DESTDIR)$(PREFIX)/share/capsa/
	install -m 0644 $(BUILD)/assets/manifest.json $(DESTDIR)$(PREFIX)/share/capsa/

# The end-to-end tests' initramfs: tests/testinit as /init.
testinitrd: deps
	CGO_ENABLED=0 $(GO) build -o $(BUILD)/testinit ./tests/testinit
	$(GO) run ./tests/cmd/mkinitrd -init $(BUILD)/testinit -o $(BUILD)/testinitrd.cpio

# The image tests' python and tools roots and the reference registry, from
# Debian's packages, cached by hash (scripts/test-images.sh).
testimages:
	scripts/test-images.sh $(BUILD)/testimages $(BUILD)/toolsimage >/dev/null

# Boot the built-in kernel to userspace and back, where KVM works (the nested
# host where this machine has no /dev/kvm).
vm: capsa testinitrd nested-deps $(NESTED)
	$(NESTED) -f $(BUILD)/capsa -f $(BUILD)/testinitrd.cpio -- ./capsa vm --initrd testinitrd.cpio --cpus 2 --boot-time

# Run a command in a sandbox, where KVM works (the nested host where this
# machine has no /dev/kvm): make run CMD='uname -a'
CMD ?= uname -a; echo hello from a capsa sandbox
run: capsa nested-deps $(NESTED)
	$(NESTED) -f $(BUILD)/capsa -- ./capsa run -- sh -c "$(CMD)"

# Tier 1: unit tests, no KVM needed. It ends with how many tests passed,
# failed and skipped; a skip not in tests/unit-expected-skips.txt fails it
# (the end-to-end tests skip here: tier 3 runs them). GNU cpio is the
# reference the cpio writer's tests compare against.
test-unit: deps
	@command -v cpio >/dev/null || scripts/apt-install.sh cpio
	$(GO) vet ./...
	cd initramfs && $(GO) vet .
	$(GO) build -o $(BUILD)/testsummary ./tests/cmd/testsummary
	set -o pipefail; $(GO) test -json ./... | $(BUILD)/testsummary -expected tests/unit-expected-skips.txt

# Every fuzz target, each for FUZZTIME: a target that dies at once (a bug
# in the harness, not the code) fails here, not only when someone fuzzes.
# Fuzzing runs on Go 1.27.1 (fetched through the module proxy): Go 1.26's
# fuzz coordinator can fail a target with a bare "context deadline exceeded"
# when -fuzztime runs out (golang/go#75804, fixed in 1.27), which it did here.
FUZZTIME ?= 5s
FUZZ_GO ?= GOTOOLCHAIN=go1.27.1 $(GO)
fuzz: deps
	@set -e; for f in $$(grep -rl --include='*_test.go' '^func Fuzz' --exclude-dir=initramfs .); do \
		for t in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
			echo "fuzz: $$t in ./$$(dirname $$f) for $(FUZZTIME)"; \
			$(FUZZ_GO) test -run '^$$' -fuzz "^$$t\$$" -fuzztime $(FUZZTIME) ./$$(dirname $$f); \
		done; done

# Tier 2: the KVM tests, run where /dev/kvm works (the nested host when absent).
test-kvm: deps nested-deps $(NESTED)
	@rm -rf $(BUILD)/kvmtests && mkdir -p $(BUILD)/kvmtests
	@for p in $(KVM_PKGS); do \
		CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/kvmtests/$$(basename $$p).test $$p || exit 1; done
	cp tests/kvm-expected-skips.txt $(BUILD)/kvmtests/expected-skips.txt
	@# One L1 crash may re-run the session (capsa-nested says so); a test
	@# that failed in any attempt fails the tier, and a re-run is reported.
	set -o pipefail; $(NESTED) --l1-retries 1 -f $(BUILD)/kvmtests:kvmtests -f tests/run-test-binaries.sh -- sh run-test-binaries.sh kvmtests \
		2>&1 | tee $(BUILD)/kvmtests.log
	@if grep -q '^capsa-nested: running the job again' $(BUILD)/kvmtests.log; then echo "test-kvm: re-run once for an L1 crash (its console tail is above)"; fi
	@! grep -q '^ *--- FAIL: ' $(BUILD)/kvmtests.log || { echo "test-kvm: FAILED: a test failed in an attempt before the re-run"; exit 1; }

# QEMU with its libraries, for the nested host's L1 (which has only
# busybox): the control VMM of the stress test and the boot benchmark.
qemu-bundle: nested-deps
	scripts/qemu-bundle.sh $(BUILD)/qemu

# Node.js 22 and the official MCP TypeScript SDK with their libraries, for
# the nested host's L1: the MCP end-to-end test's client; and npm, which
# TestWorkspacePrograms runs in a guest (cached by version).
mcp-client:
	scripts/mcp-client-bundle.sh $(BUILD)/mcp-client

# Debian 12's containerd 1.6 and ctr with their libraries, containerd 2.x
# built from its module, and crictl with the CNI plugins, for the nested
# host's L1: the shim's end-to-end tests (cached by version).
containerd-bundle:
	scripts/containerd-bundle.sh $(BUILD)/containerd
	scripts/containerd2-build.sh $(BUILD)/containerd2
	scripts/cri-tools-build.sh $(BUILD)/cri-tools

# proto regenerates the Go code of e2b/envd's .proto files (committed:
# no build needs protoc).
proto:
	scripts/gen-proto.sh

# What the end-to-end tests, `make stress` and `make bench` need in the
# nested host, beside the test binary.
E2E_FILES := $(BUILD)/capsa $(BUILD)/testinitrd.cpio $(BUILD)/testinit $(BUILD)/kernel/vmlinux \
	$(BUILD)/initramfs.cpio $(BUILD)/qemu:qemu

# Tier 3: end-to-end tests: the real binary boots the real kernel.
test-e2e: capsa testinitrd testimages nested-deps qemu-bundle mcp-client containerd-bundle $(NESTED)
	@rm -rf $(BUILD)/e2e && mkdir -p $(BUILD)/e2e
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/e2e/e2e.test ./tests/e2e
	CGO_ENABLED=0 $(GO) build -tags capsa_builtin -o $(BUILD)/e2e/example-sandbox ./examples/sandbox
	CGO_ENABLED=0 $(GO) build -ldflags "-X $(ASSETS_PKG).Prefix=/tmp/capsa-e2e-prefix" -o $(BUILD)/e2e/example-assets ./examples/sandbox
	l1=$$(scripts/nested-deps.sh) && tests/run-e2e.sh $(NESTED) $(BUILD)/e2e $(E2E_FILES) $(BUILD)/e2e/example-sandbox $(BUILD)/testimages:testimages \
		'$(BUILD)/mcp-client:mcp-client@^(TestMCP|TestWorkspacePrograms|TestWorkspaceProgramsVirtioFS|TestE2BSDK)$$' \
		'$(BUILD)/toolsimage/tools.tar.gz:tools.tar.gz@^TestWorkspacePrograms(VirtioFS)?$$' \
		$(BUILD)/containerd:containerd@^TestContainerd $(BUILD)/containerd2:containerd2@^TestContainerd \
		$(BUILD)/cri-tools:cri-tools@^TestContainerdCRI$$ \
		$(BUILD)/e2e/example-assets@^TestLibraryAssets$$ $(BUILD)/assets:assets@^TestLibraryAssets$$ \
		$$(ls $$l1/boot/vmlinuz-* | head -1):vmlinuz-debian@^TestDistroKernel$$

# The guest stress test at full size: boots and heavy 9p and network work
# under capsa and, as the control, QEMU's microvm, with every failure
# counted by kind. It runs as STRESS_SESSIONS nested host sessions (a crash
# of L1 itself ends only its session, and counts against the VMM that was
# running), then adds them up; it fails if capsa fails more often than
# QEMU. About 50 minutes; `make test` runs a short version of the boots.
STRESS_SESSIONS ?= 4
STRESS_ARGS ?= -stress.boots 25 -stress.rounds 2 -stress.bytes 67108864 -stress.boots2 3
stress: capsa testinitrd nested-deps qemu-bundle $(NESTED)
	@rm -rf $(BUILD)/stress && mkdir -p $(BUILD)/stress
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/stress/e2e.test ./tests/e2e
	$(GO) build -o $(BUILD)/stress/stress-summary ./tests/cmd/stress-summary
	l1=$$(scripts/nested-deps.sh); for i in $$(seq 1 $(STRESS_SESSIONS)); do \
		echo "=== make stress: session $$i of $(STRESS_SESSIONS)"; \
		$(NESTED) --timeout 80m --l1-retries 0 -f $(BUILD)/stress/e2e.test $(patsubst %,-f %,$(E2E_FILES)) \
			-f $$(ls $$l1/boot/vmlinuz-* | head -1):vmlinuz-debian -- \
			./e2e.test -test.run '^TestStress$$' -test.v -test.timeout 75m -stress.kernel2 vmlinuz-debian $(STRESS_ARGS) \
			2>&1 | tee $(BUILD)/stress/session-$$i.log; done
	@echo "=== make stress: all sessions"
	set -o pipefail; $(BUILD)/stress/stress-summary -fail-if-worse capsa,qemu-microvm $(BUILD)/stress/session-*.log | tee $(BUILD)/stress/results.txt

# The leak soak at full size: 200 sandboxes created, used and destroyed in
# one process (`make test` runs TestSoak's 20); and 50,000 new plain
# connections through the NAT and 5,000 over TLS each passed through and
# intercepted, every one answered (`make test` makes 2,000 and 500).
SOAK_CYCLES ?= 200
SOAK_NAT_CONNS ?= 50000
SOAK_NAT_TLS_CONNS ?= 5000
soak: capsa testinitrd nested-deps qemu-bundle $(NESTED)
	@rm -rf $(BUILD)/soak && mkdir -p $(BUILD)/soak
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/soak/e2e.test ./tests/e2e
	set -o pipefail; $(NESTED) --timeout 80m -f $(BUILD)/soak/e2e.test $(patsubst %,-f %,$(E2E_FILES)) -- \
		./e2e.test -test.run '^(TestSoak|TestNATConnectionLoad)$$' -test.v -test.timeout 75m -soak.cycles $(SOAK_CYCLES) \
		-nat.conns $(SOAK_NAT_CONNS) -nat.tls-conns $(SOAK_NAT_TLS_CONNS) | tee $(BUILD)/soak/results.txt

# The workspace's third-party tier in full: TestWorkspacePrograms with pip
# and npm too, beside the POSIX suite and the file system probe (about 25
# minutes; make test runs git, tar and cp -a, and SQLite).
test-programs: capsa testinitrd testimages nested-deps qemu-bundle mcp-client $(NESTED)
	@rm -rf $(BUILD)/programs && mkdir -p $(BUILD)/programs
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/programs/e2e.test ./tests/e2e
	set -o pipefail; $(NESTED) --timeout 80m -f $(BUILD)/programs/e2e.test $(patsubst %,-f %,$(E2E_FILES)) -f $(BUILD)/testimages:testimages \
		-f $(BUILD)/mcp-client:mcp-client -f $(BUILD)/toolsimage/tools.tar.gz:tools.tar.gz -- \
		./e2e.test -test.run '^(TestWorkspacePrograms|TestPosixSuite|TestWorkspaceFidelity)(VirtioFS)?$$' -test.v -test.timeout 75m -programs.all \
		| tee $(BUILD)/programs/results.txt

# Benchmarks, in the nested host where this machine has no /dev/kvm: boot to
# guest userspace, capsa beside QEMU's microvm on the same kernel and initramfs.
bench: capsa testinitrd testimages nested-deps qemu-bundle mcp-client containerd-bundle $(NESTED)
	@rm -rf $(BUILD)/bench && mkdir -p $(BUILD)/bench
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/bench/e2e.test ./tests/e2e
	set -o pipefail; l1=$$(scripts/nested-deps.sh); $(NESTED) -f $(BUILD)/bench/e2e.test $(patsubst %,-f %,$(E2E_FILES)) -f $(BUILD)/testimages:testimages -f $(BUILD)/mcp-client:mcp-client \
		-f $(BUILD)/containerd:containerd -f $(BUILD)/cri-tools:cri-tools -f $(BUILD)/toolsimage/tools.tar.gz:tools.tar.gz \
		-f $$(ls $$l1/boot/vmlinuz-* | head -1):vmlinuz-debian -- \
		./e2e.test -test.run '^$$' -test.bench '$(BENCH)' -test.benchtime $(BENCHTIME) | tee $(BUILD)/bench/results.txt

# Everything, tier by tier; stops at the first failing tier and names it.
test:
	@$(MAKE) --no-print-directory test-unit || { echo "make test: FAILED in tier 1 (unit tests)"; exit 1; }
	@$(MAKE) --no-print-directory fuzz || { echo "make test: FAILED in tier 1 (fuzzing)"; exit 1; }
	@$(MAKE) --no-print-directory test-kvm || { echo "make test: FAILED in tier 2 (KVM tests)"; exit 1; }
	@$(MAKE) --no-print-directory test-e2e || { echo "make test: FAILED in tier 3 (end-to-end tests)"; exit 1; }
	@echo "make test: all tiers passed"

clean:
	rm -rf $(BUILD) internal/builtin/assets
