package maps

import (
	"sync/atomic"

	"github.com/cilium/ebpf/btf"
)

// btfCache, once ShareKernelBTF has set it, holds the kernel's BTF as
// decoded by the first load of this process, for every later load. Nil:
// each load decodes what its CO-RE relocations need and drops it.
var btfCache atomic.Pointer[btf.Cache]

// ShareKernelBTF makes every later load in this process (Load, the
// closer's objects) share one decoding of the kernel's BTF. Test binaries
// call it: they load the programs hundreds of times, and decoding the
// kernel's types is about a fifth of each load. The daemon does not: it
// loads once, and keeping the decoded types would only add to its memory.
func ShareKernelBTF() { btfCache.CompareAndSwap(nil, btf.NewCache()) }
