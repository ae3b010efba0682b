// Package netstack is the user-mode NAT behind a guest's virtio-net NIC.
//
// A Stack is a gVisor network stack (gvisor.dev/gvisor/pkg/tcpip) whose one
// NIC is the guest's Ethernet link. Its NIC runs in promiscuous and spoofing
// mode, so it terminates the guest's TCP and UDP flows to any destination
// and re-originates them from the host with Config.Dial, after checking
// Config.Policy. It also serves DNS, answers ARP and ping for its own
// addresses, and forwards published host ports into the guest.
//
// # Guest network
//
// The default layout is QEMU's user networking: guest 10.0.2.15/24, gateway
// 10.0.2.2, DNS 10.0.2.3, MTU 1500 (all configurable; IPv4 only). There is
// no DHCP: the guest configures Stack.Addrs statically (e.g. the kernel's
// ip= parameter). Inside the guest:
//
//   - The gateway address stands for the host's loopback: 10.0.2.2:8080
//     reaches 127.0.0.1:8080 on the host. The policy sees 127.0.0.1, so
//     under the default public-only policy this needs an explicit rule such
//     as "127.0.0.1:8080".
//   - The DNS address serves DNS on UDP and TCP port 53. Plain DNS sent to
//     any other server on UDP port 53 is intercepted and answered the same
//     way (so domain rules and rebinding protection apply to it).
//   - Other addresses in the subnet do not exist (no ARP answer).
//   - Every address outside the subnet is reachable through the gateway, as
//     the policy allows. ARP requests for off-subnet addresses are answered
//     with the gateway's MAC too.
//   - Ping is answered for the gateway and DNS addresses only; ICMP is not
//     forwarded to the host.
//
// # Frames: the device contract
//
// The device passes each Ethernet frame the guest transmits (destination
// MAC first, no FCS, no virtio-net header) to DeliverFrame, which copies it
// and never blocks on the guest's receive side. Frames for the guest are
// read with ReadFrame (blocking, context-aware) or TryReadFrame (non-
// blocking) from a bounded queue (Config.QueueLen); when the guest does not
// drain it, further frames are dropped as a NIC would, and TCP recovers.
// Frames carry full checksums and are not padded to 60 bytes. The stack
// advertises no offloads: the device must not negotiate checksum offload
// (VIRTIO_NET_F_CSUM / GUEST_CSUM) or TSO unless it completes checksums and
// segments itself, since a frame with a partial checksum is dropped.
//
// DeliverFrame drops, silently and counted in Stats: frames from a source
// MAC other than Config.GuestMAC (when set), IPv4 packets whose source is
// not the guest's address, ARP that does not come from the guest's address,
// ARP requests for the guest's own or other on-link addresses, broadcast and
// multicast IP, IPv6 and other EtherTypes. Unparsable frames are dropped and
// reported with an error wrapping ErrMalformedFrame; no input panics.
//
// # Flows
//
// TCP: each guest SYN no local endpoint claims goes to a gVisor forwarder.
// The stack checks the policy on the destination (and the names the guest
// resolved to it through the stack's DNS), dials the host side with
// Config.Dial within Config.DialTimeout, and only then completes the
// handshake with the guest; refusal or dial failure answers RST, so the
// guest's connect fails at once. Data is then spliced both ways with
// half-close (FIN) propagation; an error on either side resets both. With
// Config.Intercept, the connection is first offered to the Interceptor
// (package tlsproxy intercepts TLS to named hosts with it), which may serve
// it itself instead.
//
// UDP: the first datagram of a flow (guest address and port, destination)
// creates a connected endpoint and a host socket; the flow ends after
// Config.UDPIdleTimeout without traffic either way. A refused flow gets ICMP
// port unreachable.
//
// Published ports (Config.Publish, ParsePublish): the Stack listens on the
// host and forwards each TCP connection, or each UDP peer's datagrams, to
// the guest's port; the guest sees them coming from the gateway address.
//
// # Policy and DNS
//
// See Policy for the rule language and precedence. The DNS server resolves
// A queries with Config.Resolver (rooted names: the host's search domains
// never apply), answers AAAA with no data (the guest network is IPv4 only),
// and NOTIMP for other types. Names a deny rule fully covers get NXDOMAIN
// without an upstream query, as does every name no allow rule covers under
// deny-all; answers the policy would not let the guest connect to (private,
// loopback, ... under public-only: DNS rebinding) are dropped from the
// answer. Each answer records name→address so that domain rules apply when
// the guest connects; the connect-time check is the authoritative one.
//
// # Audit
//
// With Config.Audit, every egress decision is on record as a Flow: each DNS
// query with its answer (the addresses given, and how many the policy left
// out) or its refusal; each TCP connection and UDP flow refused (with the
// rule that refused it: Verdict.Rule), failed (the host's side could not be
// reached), opened, and closed (bytes each way and duration). A DNS query
// the guest sends to any other server is answered here and logged the
// same way. Refusals past 50 a second are left out and counted; a summary
// line a second later says how many. Stack.FlowCounts sums the flows each
// rule allowed and refused, whether or not there is a log.
//
// # Limits
//
// Config.MaxConns and Config.MaxUDPFlows bound host sockets, Config.TCPBuffer
// each TCP flow's buffers (so host memory is bounded by MaxConns x 2 x
// TCPBuffer), the gVisor forwarder bounds concurrent pending handshakes
// (512), and the DNS server
// bounds concurrent queries; policy refusals are logged at Info, rate
// limited, so a guest cannot flood the log.
package netstack
