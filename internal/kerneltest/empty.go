package kerneltest

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	ebpflink "github.com/cilium/ebpf/link"
)

// EmptyPrograms attaches at cg a connect4 and a sockops program that only
// return: the floor of what the programs' calls cost a connection, for
// benchmarks to measure beside breakerd's. The empty sockops
// program sets no callback flags, so it runs only for the callbacks every
// active connect makes (five), one fewer than breakerd's. With callbacks,
// the sockops program instead asks for the callbacks breakerd's asks for
// and nothing else: at the connect callback the state and RTO callbacks,
// at the established one the RTO callback alone (so it runs six times, as
// breakerd's does, and its two flag settings are helper calls breakerd's
// makes too). It returns the programs by hook ("connect4", "sockops");
// they are detached and closed when the test ends.
func EmptyPrograms(tb testing.TB, cg *Cgroup, callbacks bool) map[string]*ebpf.Program {
	tb.Helper()
	progs := map[string]*ebpf.Program{}
	for _, p := range []struct {
		name   string
		typ    ebpf.ProgramType
		attach ebpf.AttachType
	}{{"connect4", ebpf.CGroupSockAddr, ebpf.AttachCGroupInet4Connect}, {"sockops", ebpf.SockOps, ebpf.AttachCGroupSockOps}} {
		insns := asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}
		if callbacks && p.typ == ebpf.SockOps {
			insns = asm.Instructions{
				// r1 is the context; op is its first field.
				asm.LoadMem(asm.R2, asm.R1, 0, asm.Word),
				asm.JEq.Imm(asm.R2, 3, "connect"),     // BPF_SOCK_OPS_TCP_CONNECT_CB
				asm.JEq.Imm(asm.R2, 4, "established"), // BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
				asm.Mov.Imm(asm.R0, 1),
				asm.Return(),
				asm.Mov.Imm(asm.R2, 4|1).WithSymbol("connect"), // STATE | RTO
				asm.FnSockOpsCbFlagsSet.Call(),
				asm.Mov.Imm(asm.R0, 1),
				asm.Return(),
				asm.Mov.Imm(asm.R2, 1).WithSymbol("established"), // RTO
				asm.FnSockOpsCbFlagsSet.Call(),
				asm.Mov.Imm(asm.R0, 1),
				asm.Return(),
			}
		}
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: p.typ, AttachType: p.attach, License: "GPL",
			Instructions: insns})
		if err != nil {
			tb.Fatalf("loading an empty %s program: %v", p.name, err)
		}
		tb.Cleanup(func() { prog.Close() })
		l, err := ebpflink.AttachCgroup(ebpflink.CgroupOptions{Path: cg.Path, Attach: p.attach, Program: prog})
		if err != nil {
			tb.Fatalf("attaching an empty %s program: %v", p.name, err)
		}
		tb.Cleanup(func() { l.Close() })
		progs[p.name] = prog
	}
	return progs
}
