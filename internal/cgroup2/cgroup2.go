// Package cgroup2 finds the cgroup v2 hierarchy.
package cgroup2

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
)

// Mount returns the mount point of the cgroup v2 hierarchy, read
// from /proc/mounts: /sys/fs/cgroup on unified systems,
// /sys/fs/cgroup/unified on hybrid ones.
func Mount() (string, error) {
	f, err := os.Open("/proc/mounts")
	if err != nil {
		return "", fmt.Errorf("reading mounts: %w", err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 3 && fields[2] == "cgroup2" {
			return fields[1], nil
		}
	}
	if err := s.Err(); err != nil {
		return "", fmt.Errorf("reading mounts: %w", err)
	}
	return "", errors.New("no cgroup v2 mount in /proc/mounts")
}

// MountOf returns the cgroup v2 mount point that holds path: the longest
// cgroup2 mount in /proc/mounts that is path or a directory above it.
func MountOf(path string) (string, error) {
	data, err := os.ReadFile("/proc/mounts")
	if err != nil {
		return "", fmt.Errorf("reading mounts: %w", err)
	}
	best := ""
	for _, line := range strings.Split(string(data), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 3 || fields[2] != "cgroup2" {
			continue
		}
		m := fields[1]
		if (path == m || strings.HasPrefix(path, strings.TrimSuffix(m, "/")+"/")) && len(m) > len(best) {
			best = m
		}
	}
	if best == "" {
		return "", fmt.Errorf("%s is on no cgroup v2 mount in /proc/mounts", path)
	}
	return best, nil
}
