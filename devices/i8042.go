package devices

import "sync"

// I8042 is the part of the PS/2 controller a guest uses to reset the machine
// (Linux's reboot=k): port 0x64 reads as an idle controller, and the pulse
// reset command 0xfe, or an output-port write with the reset bit low, calls
// the reset callback.
//
// The controller's self tests and the auxiliary port's loopback are
// answered at once, the answers saying there is no mouse port: a guest
// kernel with an i8042 driver (a distribution's) otherwise polls the status
// port thousands of times per test waiting for a reply, each poll an exit
// to the VMM, which takes tens of seconds under nested virtualization.
type I8042 struct {
	mu         sync.Mutex
	reset      func()
	cmd        uint8 // last command awaiting a data byte on port 0x60
	commandReg uint8
	outBuf     []byte
}

// I8042 ports and commands.
const (
	I8042DataPort    = 0x60
	I8042CommandPort = 0x64

	i8042CmdReadCmdByte  = 0x20
	i8042CmdWriteCmdByte = 0x60
	i8042CmdAuxTest      = 0xa9
	i8042CmdSelfTest     = 0xaa
	i8042CmdKbdTest      = 0xab
	i8042CmdWriteOutput  = 0xd1
	i8042CmdAuxLoop      = 0xd3
	i8042CmdResetPulse   = 0xfe

	i8042SelfTestOK  = 0x55
	i8042KbdTestOK   = 0x00
	i8042AuxTestFail = 0x01 // "clock line stuck low": no auxiliary port

	i8042StatusOutputFull = 0x01
	i8042StatusSystem     = 0x04
)

// NewI8042 returns a controller that calls reset when the guest asks for a reset.
func NewI8042(reset func()) *I8042 {
	return &I8042{reset: reset, commandReg: 0x45}
}

// Read implements Device; it is registered at port 0x60 with size 5
// so offset 0 is data and offset 4 is status.
func (k *I8042) Read(off uint64, data []byte) {
	for i := range data {
		data[i] = 0
	}
	if len(data) == 0 {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	switch off {
	case 0:
		if len(k.outBuf) > 0 {
			data[0] = k.outBuf[0]
			k.outBuf = k.outBuf[1:]
		}
	case 4:
		st := uint8(i8042StatusSystem)
		if len(k.outBuf) > 0 {
			st |= i8042StatusOutputFull
		}
		data[0] = st
	}
}

// Write implements Device.
func (k *I8042) Write(off uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	v := data[0]
	reset := false
	k.mu.Lock()
	switch off {
	case 0:
		switch k.cmd {
		case i8042CmdWriteCmdByte:
			k.commandReg = v
		case i8042CmdWriteOutput:
			reset = v&0x01 == 0 // bit 0 is the CPU reset line, active low
		case i8042CmdAuxLoop:
			// A real port echoes the byte back as if from the mouse; a
			// different byte fails Linux's loopback test, and the port
			// test that follows says there is no port.
			k.outBuf = append(k.outBuf[:0], ^v)
		}
		k.cmd = 0
	case 4:
		switch v {
		case i8042CmdResetPulse:
			reset = true
		case i8042CmdReadCmdByte:
			k.outBuf = append(k.outBuf[:0], k.commandReg)
		case i8042CmdWriteCmdByte, i8042CmdWriteOutput, i8042CmdAuxLoop:
			k.cmd = v
		case i8042CmdSelfTest:
			k.outBuf = append(k.outBuf[:0], i8042SelfTestOK)
		case i8042CmdKbdTest:
			k.outBuf = append(k.outBuf[:0], i8042KbdTestOK)
		case i8042CmdAuxTest:
			k.outBuf = append(k.outBuf[:0], i8042AuxTestFail)
		}
	}
	k.mu.Unlock()
	if reset && k.reset != nil {
		k.reset()
	}
}
