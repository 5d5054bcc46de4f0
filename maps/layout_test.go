package maps

import (
	"bytes"
	"embed"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/breakerd/breakerd/bpf"
)

// golden holds the recorded layouts, embedded so that the test binary
// carries them into a VM (scripts/vmtest runs it without the source tree).
//
//go:embed testdata/layout-v*.txt
var golden embed.FS

var update = flag.Bool("update", false, "write the current layout to testdata/layout-v<LayoutVersion>.txt")

// describeLayout writes down everything a pinned map or a record's reader
// depends on: each map's type, sizes, capacity, flags and pinning, and the
// layout (offset, size and type of every field) of every struct the maps
// and the ring buffer carry.
func describeLayout(spec *ebpf.CollectionSpec) (string, error) {
	var b strings.Builder
	names := make([]string, 0, len(spec.Maps))
	for n := range spec.Maps {
		if !strings.HasPrefix(n, ".") { // .rodata and friends are not pinned
			names = append(names, n)
		}
	}
	sort.Strings(names)
	structs := map[string]btf.Type{}
	for _, n := range names {
		m := spec.Maps[n]
		fmt.Fprintf(&b, "map %s: type=%s key=%d value=%d max_entries=%d flags=%#x pinning=%d\n",
			n, m.Type, m.KeySize, m.ValueSize, m.MaxEntries, m.Flags, m.Pinning)
		for _, t := range []btf.Type{m.Key, m.Value} {
			if s, ok := btf.UnderlyingType(t).(*btf.Struct); ok {
				structs[s.Name] = s
			}
		}
	}
	for _, name := range []string{"event"} {
		var s *btf.Struct
		if err := spec.Types.TypeByName(name, &s); err != nil {
			return "", fmt.Errorf("struct %s: %w", name, err)
		}
		structs[name] = s
	}
	snames := make([]string, 0, len(structs))
	for n := range structs {
		snames = append(snames, n)
	}
	sort.Strings(snames)
	for _, n := range snames {
		s := structs[n].(*btf.Struct)
		fmt.Fprintf(&b, "struct %s: size=%d\n", n, s.Size)
		for _, m := range s.Members {
			size, err := btf.Sizeof(m.Type)
			if err != nil {
				return "", err
			}
			fmt.Fprintf(&b, "  %s: offset=%d size=%d type=%s bits=%d\n", m.Name, m.Offset.Bytes(), size, typeName(m.Type), m.BitfieldSize)
		}
	}
	for _, name := range []string{"verdict_state", "config_flags", "stat_index", "outcome", "event_flags"} {
		var e *btf.Enum
		if err := spec.Types.TypeByName(name, &e); err != nil {
			return "", fmt.Errorf("enum %s: %w", name, err)
		}
		fmt.Fprintf(&b, "enum %s:", name)
		for _, v := range e.Values {
			fmt.Fprintf(&b, " %s=%d", v.Name, v.Value)
		}
		b.WriteString("\n")
	}
	// The verdict mask's hash is layout too: pinned settings carry bits
	// of it (TestVerdictMaskBucketsAgreeWithKernel ties it to the kernel's).
	b.WriteString("verdict_bucket:")
	for _, d := range []string{"192.0.2.1:80", "192.0.2.1:443", "198.51.100.7:5432", "[2001:db8::1]:80", "[2001:db8::2]:6379"} {
		key := Dest{Proto: TCP, Addr: netip.MustParseAddrPort(d)}.Key()
		fmt.Fprintf(&b, " %d", verdictBucket(&key))
		key.Class = 3
		fmt.Fprintf(&b, " %d", verdictBucket(&key))
	}
	b.WriteString("\n")
	return b.String(), nil
}

func typeName(t btf.Type) string {
	switch t := btf.UnderlyingType(t).(type) {
	case *btf.Int:
		return t.Name
	case *btf.Array:
		return fmt.Sprintf("%s[%d]", typeName(t.Type), t.Nelems)
	case *btf.Struct:
		return "struct " + t.Name
	case *btf.Enum:
		return "enum " + t.Name
	}
	return fmt.Sprintf("%T", t)
}

func goldenPath(version int) string {
	return filepath.Join("testdata", fmt.Sprintf("layout-v%d.txt", version))
}

// TestLayoutVersionMatchesLayout ties LayoutVersion to the layout: the
// layout of this version is recorded in testdata, and a change to a map or
// a shared struct without a version bump fails here, as does a bump
// without a change.
func TestLayoutVersionMatchesLayout(t *testing.T) {
	spec, err := bpf.LoadBreaker()
	if err != nil {
		t.Fatal(err)
	}
	got, err := describeLayout(spec)
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		if err := os.WriteFile(goldenPath(LayoutVersion), []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := golden.ReadFile(goldenPath(LayoutVersion))
	if err != nil {
		t.Fatalf("no recorded layout for v%d (%v): after bumping LayoutVersion, record it with go test ./maps -run TestLayoutVersionMatchesLayout -update", LayoutVersion, err)
	}
	if string(want) != got {
		t.Fatalf("the map or struct layout differs from the one recorded for v%d: bump LayoutVersion and record the new layout "+
			"(go test ./maps -run TestLayoutVersionMatchesLayout -update); only when v%d was never released may its record be updated in place.\nrecorded:\n%s\nnow:\n%s",
			LayoutVersion, LayoutVersion, want, got)
	}
	if prev, err := golden.ReadFile(goldenPath(LayoutVersion - 1)); err == nil && bytes.Equal(prev, want) {
		t.Fatalf("v%d records the same layout as v%d: a version bump without a layout change makes every restart start from empty maps", LayoutVersion, LayoutVersion-1)
	}
}
