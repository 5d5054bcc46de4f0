package maps

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"reflect"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/bpf"
)

// encodeEvent lays r out as the kernel writes a record: the generated
// struct event (from breaker.h's BTF) in the host's byte order.
func encodeEvent(t testing.TB, r *bpf.BreakerEvent) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.NativeEndian, r); err != nil {
		t.Fatal(err)
	}
	if buf.Len() != EventSize {
		t.Fatalf("encoded %d bytes, EventSize is %d", buf.Len(), EventSize)
	}
	return buf.Bytes()
}

// TestDecodeEventRoundTrip encodes records of the generated struct event
// and decodes them with DecodeEvent: every field lands where it belongs,
// err as a Response's HTTP status and as any other record's errno.
func TestDecodeEventRoundTrip(t *testing.T) {
	v4 := Dest{Proto: TCP, Addr: netip.MustParseAddrPort("198.51.100.7:8080"), Class: 2}
	v6 := Dest{Proto: TCP, Addr: netip.MustParseAddrPort("[2001:db8::5]:443")}
	const cookie, cgroup, ts = 0x0102030405060708, 0x1112131415161718, 0x2122232425262728
	for _, c := range []struct {
		name string
		raw  bpf.BreakerEvent
		want Event
	}{
		{"refused probe", bpf.BreakerEvent{
			Dest: v4.Key(), Outcome: uint8(Refused), Flags: uint8(bpf.BreakerEventFlagsEVENT_PROBE),
			Err: uint16(syscall.ECONNREFUSED), Count: 3, Round: 7, DurationNs: 1500000,
			Cookie: cookie, CgroupId: cgroup, TsNs: ts,
		}, Event{
			Dest: v4, Outcome: Refused, Probe: true, Err: syscall.ECONNREFUSED, Count: 3, Round: 7,
			Duration: 1500 * time.Microsecond, Cookie: cookie, CgroupID: cgroup, Time: ts,
		}},
		{"http response", bpf.BreakerEvent{
			Dest: v6.Key(), Outcome: uint8(Response), Flags: uint8(bpf.BreakerEventFlagsEVENT_HTTP),
			Err: 503, Count: 2, DurationNs: 42, Cookie: cookie, CgroupId: cgroup, TsNs: ts,
		}, Event{
			Dest: v6, Outcome: Response, HTTP: true, Status: 503, Count: 2,
			Duration: 42, Cookie: cookie, CgroupID: cgroup, Time: ts,
		}},
		{"no response, peer closed", bpf.BreakerEvent{
			Dest: v6.Key(), Outcome: uint8(NoResponse), Flags: uint8(bpf.BreakerEventFlagsEVENT_PEER_CLOSED),
			Err: uint16(syscall.ECONNRESET), Count: 1, DurationNs: 9, Cookie: cookie, TsNs: ts,
		}, Event{
			Dest: v6, Outcome: NoResponse, PeerClosed: true, Err: syscall.ECONNRESET, Count: 1,
			Duration: 9, Cookie: cookie, Time: ts,
		}},
		{"reset of unknown age", bpf.BreakerEvent{
			Dest: v4.Key(), Outcome: uint8(Reset), Flags: uint8(bpf.BreakerEventFlagsEVENT_NO_AGE),
			Err: uint16(syscall.EPIPE), Cookie: cookie, CgroupId: cgroup, TsNs: ts,
		}, Event{
			Dest: v4, Outcome: Reset, NoAge: true, Err: syscall.EPIPE, Cookie: cookie, CgroupID: cgroup, Time: ts,
		}},
	} {
		var got Event
		if err := DecodeEvent(encodeEvent(t, &c.raw), &got); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got != c.want {
			t.Errorf("%s: decoded\n%+v\nwant\n%+v", c.name, got, c.want)
		}
	}
}

// TestDecodeEventReadsEveryField changes each field of the generated
// struct event (each byte of an array) on its own and checks that the
// decoded Event changes with it: a field added to struct event in
// breaker.h that DecodeEvent does not read fails here.
func TestDecodeEventReadsEveryField(t *testing.T) {
	var raw bpf.BreakerEvent
	raw.Outcome = uint8(Refused)
	var base Event
	if err := DecodeEvent(encodeEvent(t, &raw), &base); err != nil {
		t.Fatal(err)
	}
	fields := 0
	var walk func(v reflect.Value, path string)
	walk = func(v reflect.Value, path string) {
		switch v.Kind() {
		case reflect.Struct:
			for i := range v.NumField() {
				if f := v.Type().Field(i); f.Name != "_" {
					walk(v.Field(i), path+"."+f.Name)
				}
			}
		case reflect.Array:
			for i := range v.Len() {
				walk(v.Index(i), fmt.Sprintf("%s[%d]", path, i))
			}
		case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			fields++
			old := v.Uint()
			v.SetUint(old + 1)
			var got Event
			if err := DecodeEvent(encodeEvent(t, &raw), &got); err != nil {
				t.Fatal(err)
			}
			if got == base {
				t.Errorf("%s: DecodeEvent does not read it (the decoded Event is the same)", path)
			}
			v.SetUint(old)
		default:
			t.Errorf("%s: a %s, which this test does not know how to change", path, v.Kind())
		}
	}
	walk(reflect.ValueOf(&raw).Elem(), "event")
	if fields < 11 {
		t.Fatalf("walked %d fields of struct event", fields)
	}
}
