# capsa: see README.md. Every target installs what it needs.
SHELL := /bin/bash
GO ?= go
export CAPSA_CACHE ?= $(HOME)/.cache/capsa
BUILD := build
NESTED := $(BUILD)/capsa-nested
# Test binaries for the KVM tier: packages whose tests need /dev/kvm.
KVM_PKGS := ./kvm ./vmm
BENCHTIME ?= 5x

.PHONY: all deps kernel initramfs nested-deps capsa testinitrd vm run test test-unit test-kvm test-e2e bench clean

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

# The guest initramfs: u-root's core commands and gosh, the agent as /init.
initramfs: deps
	CGO_ENABLED=0 $(GO) build -o $(BUILD)/capsa-agent ./agent/cmd/capsa-agent
	scripts/build-initramfs.sh $(BUILD)/capsa-agent $(BUILD)/initramfs.cpio

# The capsa binary with the guest kernel and initramfs built in: one static file.
capsa: deps kernel initramfs
	cp $(BUILD)/kernel/vmlinux internal/builtin/vmlinux
	cp $(BUILD)/initramfs.cpio internal/builtin/initramfs.cpio
	CGO_ENABLED=0 $(GO) build -tags capsa_builtin -ldflags "-X main.version=$$(git describe --always --dirty 2>/dev/null || echo dev)" -o $(BUILD)/capsa ./cmd/capsa
	@ls -l $(BUILD)/capsa

# The end-to-end tests' initramfs: tests/testinit as /init.
testinitrd: deps
	CGO_ENABLED=0 $(GO) build -o $(BUILD)/testinit ./tests/testinit
	$(GO) run ./tests/cmd/mkinitrd -init $(BUILD)/testinit -o $(BUILD)/testinitrd.cpio

# Boot the built-in kernel to userspace and back, where KVM works (the nested
# host where this machine has no /dev/kvm).
vm: capsa testinitrd nested-deps $(NESTED)
	$(NESTED) -f $(BUILD)/capsa -f $(BUILD)/testinitrd.cpio -- ./capsa vm --initrd testinitrd.cpio --cpus 2 --boot-time

# Run a command in a sandbox, where KVM works (the nested host where this
# machine has no /dev/kvm): make run CMD='uname -a'
CMD ?= uname -a; echo hello from a capsa sandbox
run: capsa nested-deps $(NESTED)
	$(NESTED) -f $(BUILD)/capsa -- ./capsa run -- sh -c "$(CMD)"

# Tier 1: unit tests, no KVM needed. KVM tests skip here when /dev/kvm is absent.
test-unit: deps
	$(GO) vet ./...
	cd initramfs && $(GO) vet .
	$(GO) test ./...

# Tier 2: the KVM tests, run where /dev/kvm works (the nested host when absent).
test-kvm: deps nested-deps $(NESTED)
	@rm -rf $(BUILD)/kvmtests && mkdir -p $(BUILD)/kvmtests
	@for p in $(KVM_PKGS); do \
		CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/kvmtests/$$(basename $$p).test $$p || exit 1; done
	$(NESTED) -f $(BUILD)/kvmtests:kvmtests -f tests/run-test-binaries.sh -- sh run-test-binaries.sh kvmtests

# Tier 3: end-to-end tests: the real binary boots the real kernel.
test-e2e: capsa testinitrd nested-deps $(NESTED)
	@rm -rf $(BUILD)/e2e && mkdir -p $(BUILD)/e2e
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/e2e/e2e.test ./tests/e2e
	CGO_ENABLED=0 $(GO) build -tags capsa_builtin -o $(BUILD)/e2e/example-sandbox ./examples/sandbox
	tests/run-e2e.sh $(NESTED) $(BUILD)/e2e $(BUILD)/capsa $(BUILD)/testinitrd.cpio $(BUILD)/kernel/vmlinux \
		$(BUILD)/initramfs.cpio $(BUILD)/e2e/example-sandbox

# Benchmarks, in the nested host where this machine has no /dev/kvm: boot to
# guest userspace, capsa beside QEMU's microvm on the same kernel and initramfs.
bench: capsa testinitrd nested-deps $(NESTED)
	@rm -rf $(BUILD)/bench && mkdir -p $(BUILD)/bench
	CGO_ENABLED=0 $(GO) test -c -o $(BUILD)/bench/e2e.test ./tests/e2e
	scripts/qemu-bundle.sh $(BUILD)/bench/qemu
	set -o pipefail; $(NESTED) -f $(BUILD)/bench/e2e.test -f $(BUILD)/capsa -f $(BUILD)/testinitrd.cpio \
		-f $(BUILD)/kernel/vmlinux -f $(BUILD)/initramfs.cpio -f $(BUILD)/bench/qemu:qemu -- \
		./e2e.test -test.run '^$$' -test.bench . -test.benchtime $(BENCHTIME) | tee $(BUILD)/bench/results.txt

# Everything, tier by tier; stops at the first failing tier and names it.
test:
	@$(MAKE) --no-print-directory test-unit || { echo "make test: FAILED in tier 1 (unit tests)"; exit 1; }
	@$(MAKE) --no-print-directory test-kvm || { echo "make test: FAILED in tier 2 (KVM tests)"; exit 1; }
	@$(MAKE) --no-print-directory test-e2e || { echo "make test: FAILED in tier 3 (end-to-end tests)"; exit 1; }
	@echo "make test: all tiers passed"

clean:
	rm -rf $(BUILD) internal/builtin/vmlinux internal/builtin/initramfs.cpio
