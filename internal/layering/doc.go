// Package layering holds only a test: the rules of docs/architecture.md
// on which package may import which, checked on every Go file of the
// module (non-test files), so that a change that breaks one fails the
// unit tier instead of waiting for a reviewer:
//
//   - the front ends (cmd/capsa, mcp, e2b, shim) are adapters over the
//     manager (package supervisor) and the library (package sandbox):
//     none imports kvm, vmm, a virtio device, confine, snapshot or store;
//   - only kvm imports unsafe, less the few named with their reasons;
//   - only vmm wires KVM to devices: kvm is imported by vmm alone, less
//     the few named with their reasons; devices know nothing of KVM;
//   - the engine never imports a front end.
//
// Its starting point is the import rules Go's own tree checks in
// go/build's deps_test.go, written small: a table of prefixes, not a
// grammar.
package layering
