package policy

import (
	"encoding/json"
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
