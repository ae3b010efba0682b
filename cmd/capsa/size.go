package main

import (
	"fmt"
	"strconv"
	"strings"
)

// parseSize reads a memory size such as 512M, 2G, 1GiB or 268435456 (bytes).
func parseSize(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "i")
	mult := uint64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'k', 'K':
			mult, t = 1<<10, t[:n-1]
		case 'm', 'M':
			mult, t = 1<<20, t[:n-1]
		case 'g', 'G':
			mult, t = 1<<30, t[:n-1]
		}
	}
	v, err := strconv.ParseUint(t, 10, 64)
	if err != nil || v == 0 || v > (1<<40)/mult {
		return 0, fmt.Errorf("invalid size %q (want a positive size such as 512M or 2G)", s)
	}
	return v * mult, nil
}
