package policy

import (
	"encoding/json"
	"strconv"
	"testing"

	"github.com/breakerd/breakerd/bpf"
)

// TestKernelFailureStatuses checks that the statuses the kernel treats as
// failures by itself (breaker.h's enum http_failure) are exactly the
// default failure_statuses: with that default the kernel counts every
// other status as an ordinary success without telling the daemon.
func TestKernelFailureStatuses(t *testing.T) {
	var def []any
	if err := json.Unmarshal([]byte(defaultFailureStatuses), &def); err != nil {
		t.Fatal(err)
	}
	o := DefaultOptions()
	if err := setStatuses(&o.Responses.FailureStatuses, def); err != nil {
		t.Fatal(err)
	}
	for s := uint16(100); s <= 599; s++ {
		kernel := s == uint16(bpf.BreakerHttpFailureHTTP_TOO_MANY_REQUESTS) ||
			s >= uint16(bpf.BreakerHttpFailureHTTP_SERVER_ERROR_MIN) && s <= uint16(bpf.BreakerHttpFailureHTTP_SERVER_ERROR_MAX)
		if policy := o.Responses.FailureStatuses.Has(s); policy != kernel {
			t.Errorf("status %d: a failure to policy's default %v, to the kernel %v", s, policy, kernel)
		}
	}
}

// TestKernelDefaults checks the defaults the kernel falls back on where
// the daemon leaves a setting 0 (breaker.h's enum defaults) against
// policy's defaults and their documentation.
func TestKernelDefaults(t *testing.T) {
	c, err := Parse([]byte("mode: enforce\n"), false)
	if err != nil {
		t.Fatal(err)
	}
	want := int(bpf.BreakerDefaultsDEFAULT_MAX_RTO)
	if c.MaxRTO != want {
		t.Errorf("max_rto defaults to %d, the kernel's DEFAULT_MAX_RTO is %d", c.MaxRTO, want)
	}
	for _, f := range topFields {
		if f.key == "max_rto" && f.def != strconv.Itoa(want) {
			t.Errorf("max_rto is documented to default to %s, the kernel's DEFAULT_MAX_RTO is %d", f.def, want)
		}
	}
}
