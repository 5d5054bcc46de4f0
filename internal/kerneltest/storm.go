package kerneltest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// CgroupStorm makes (remove false) or removes n cgroups storm-NNNNN below
// dir as fast as one goroutine can, and closes half once half are done (or
// it stopped early). The returned channel has the first error, or nil, once
// it ends.
func CgroupStorm(wg *sync.WaitGroup, dir string, n int, remove bool, half chan<- struct{}) <-chan error {
	done := make(chan error, 1)
	wg.Go(func() {
		var err error
		halfway := false
		defer func() {
			if !halfway {
				close(half) // stopped early: the caller reads done
			}
		}()
		for i := range n {
			if i == n/2 {
				close(half)
				halfway = true
			}
			p := filepath.Join(dir, fmt.Sprintf("storm-%05d", i))
			if remove {
				err = os.Remove(p)
			} else {
				err = os.Mkdir(p, 0o755)
			}
			if err != nil {
				break
			}
		}
		done <- err
	})
	return done
}

// RemoveCgroupStorm removes every storm-* cgroup below dir (they hold no
// process).
func RemoveCgroupStorm(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "storm-") {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
