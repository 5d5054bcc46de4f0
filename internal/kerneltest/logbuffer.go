package kerneltest

import (
	"bytes"
	"slices"
	"sync"
)

// LogBuffer collects what a process or daemon writes (its log) while the
// test reads it; safe for concurrent use.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *LogBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *LogBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Percentile returns the p-th percentile (0–100) of xs, nearest rank; 0
// for no samples. xs is not modified.
func Percentile(xs []int64, p int) int64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[min(len(s)-1, len(s)*p/100)]
}
